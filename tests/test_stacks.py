"""Naming user stack frames (no BPF: a stand-in for bcc's stack table; the maps and
files read are this process's and a forked child's, for real, and bcc's own naming, run
in a child process, is the reference)."""

from __future__ import annotations

import ctypes
import json
import re
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from trainbpf.tracer.symbols.anon import AnonymousCode, PerfMap
from trainbpf.tracer.symbols.stacks import StackSymbolizer


class FakeStackTable:
    class Key(int):
        pass

    class Leaf:
        def __init__(self, ips):
            self.ip = (ctypes.c_uint64 * 32)(*ips)

    def __init__(self, stacks: dict[int, list[int]]):
        self.stacks = stacks

    def __getitem__(self, key):
        if int(key) not in self.stacks:
            raise KeyError(key)
        return self.Leaf(self.stacks[int(key)])


class FakeBpf:
    """bcc's BPF as StackSymbolizer uses it: the stack table.  Its per-process symbol
    lookup must never be called (tracer/symbols/anon.py says why)."""

    def __init__(self, stacks):
        self.table = FakeStackTable(stacks)

    def __getitem__(self, name):
        assert name == "stacks"
        return self.table

    def sym(self, addr, pid, show_module=False):
        raise AssertionError("bcc's per-process symbol lookup closes descriptors it does not own")


def forked_child() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    return pid


def names(batch):
    rows = batch.to_pydict()
    return dict(zip(zip(rows["kstack_id"], rows["pid"]), rows["name"]))


def test_a_forked_process_is_named_from_its_parents_files_after_it_exits():
    """User frames are placed while the processes live and named after the stop: the
    same libc code in a parent and its forked worker gets one name, read from the file's
    own symbols, though the worker is gone by then; anonymous code (a JIT's) is named
    from the process's perf map, at once; an address in no executable mapping (a
    frame-pointer walk gone astray into data) is left as a number."""
    libc = ctypes.CDLL(None)
    code = ctypes.cast(libc.getpid, ctypes.c_void_p).value  # libc's text
    data = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    stray = ctypes.addressof(ctypes.c_char.from_buffer(data))
    jit_area = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    jit = ctypes.addressof(ctypes.c_char.from_buffer(jit_area))
    child = forked_child()
    perf_maps = [f"/tmp/perf-{pid}.map" for pid in (os.getpid(), child)]
    try:
        for path in perf_maps:
            with open(path, "w") as fh:
                fh.write(f"{jit - 64:x} 40 before\n{jit:x} 100 jitted_step\n")
        bpf = FakeBpf({1: [code, jit, stray], 2: [code + 16]})
        sym = StackSymbolizer(bpf)
        assert sym.symbolize([], np.array([(1, os.getpid())])) is None  # placed, not yet named
        sym.symbolize([], np.array([(1, child), (2, child)]))
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        for path in perf_maps:
            os.unlink(path)
    got = names(sym.finish())  # the worker has exited
    sym.close()
    getpid = "getpid [libc.so.6]"
    assert got[(1, os.getpid())] == f"{getpid};jitted_step [perf-{os.getpid()}.map];0x{stray:x}"
    assert got[(1, child)] == f"{getpid};jitted_step [perf-{child}.map];0x{stray:x}"
    assert got[(2, child)].endswith("[libc.so.6]") and got[(2, child)] != f"0x{code + 16:x}"


def test_a_perf_map_names_only_what_it_covers_and_only_its_owners():
    perf_map = PerfMap("1000 10 first\n2000 8 second\nnot a line\n3000 zz bad\n")
    assert [perf_map.name(a) for a in (0xfff, 0x1000, 0x100f, 0x1010, 0x2007, 0x2008)] == \
        [None, "first", "first", None, "second", None]
    # Someone else's file at the process's perf map path is not read (anyone may write /tmp).
    path = f"/tmp/perf-{os.getpid()}.map"
    with open(path, "w") as fh:
        fh.write("1000 10 planted\n")
    try:
        os.chown(path, 65534, 65534)
        assert AnonymousCode().name(0x1000, os.getpid(), None) is None
        os.chown(path, os.getuid(), os.getgid())
        assert AnonymousCode().name(0x1000, os.getpid(), None) == f"planted [perf-{os.getpid()}.map]"
    finally:
        os.unlink(path)


def test_vdso_code_is_named_from_the_kernels_image():
    from trainbpf.tracer.symbols.maps import ProcMaps

    index = ProcMaps().of(os.getpid())
    vdso = next(m for m in index.maps if m.path == "[vdso]")
    names = {AnonymousCode().name(addr, os.getpid(), vdso) for addr in range(vdso.start, vdso.end, 16)}
    named = {n for n in names if n}
    assert named and all(n.endswith(" [[vdso]]") for n in named), names
    assert "__vdso_clock_gettime [[vdso]]" in named, named


# bcc's names for addresses of process `pid`, looked up in a child process of their own:
# Debian's bcc closes a descriptor number it never opened on each lookup (anon.py).
BCC_NAMES = """
import json, sys
from bcc import BPF
pid, addrs = json.loads(sys.stdin.read())
print(json.dumps([BPF.sym(a, pid, show_module=True).decode(errors="replace") for a in addrs]))
"""


def bcc_names(pid: int, addrs: list[int]) -> list[str]:
    run = subprocess.run([sys.executable, "-c", BCC_NAMES], input=json.dumps([pid, addrs]), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_frames_are_named_as_bcc_names_them():
    """Code addresses of this process, named from the files' symbols (their debug
    files' too), against bcc's own lookup: the same function, or another name for the
    same address (libc exports aliases)."""
    from trainbpf.tracer.symbols.maps import ProcMaps
    from trainbpf.tracer.symbols.stacks import MappedFiles

    index = ProcMaps().of(os.getpid())
    files = MappedFiles()
    rng = np.random.default_rng(7)
    ours = {}
    try:
        for m in index.maps:
            if not (m.executable and m.path.startswith("/") and m.file[1] and files.hold(os.getpid(), m)):
                continue
            for addr in rng.integers(m.start, m.end, 20).tolist():
                ours[addr] = files.name((*m.file, addr - m.start + m.offset))
    finally:
        files.close()
    same = 0
    for addr, theirs in zip(ours, bcc_names(os.getpid(), list(ours))):
        same += ours[addr] == theirs
        if ours[addr] != theirs:  # an alias (libc exports several names for one function)
            assert ours[addr].rsplit(" [", 1)[1] == theirs.rsplit(" [", 1)[1], (ours[addr], theirs)
            assert not ours[addr].startswith("[unknown]") and not theirs.startswith("[unknown]"), (ours[addr], theirs)
    assert len(ours) >= 200 and same >= 0.9 * len(ours), (same, len(ours))


def test_a_stack_ends_at_its_first_zero_or_after_32_frames():
    full = list(range(0x10000, 0x10000 + 32))
    bpf = FakeBpf({1: [0x20000, 0x20010], 2: full})
    sym = StackSymbolizer(bpf)
    sym.symbolize([], np.array([(1, os.getpid()), (2, os.getpid())]))
    got = names(sym.finish())
    assert got[(1, os.getpid())].count(";") == 1
    assert got[(2, os.getpid())].count(";") == 31


def test_a_flushs_stack_references_leave_out_nulls_failures_and_interrupt_wakers():
    """kernel_refs and user_refs: the distinct ids (user ids with the pid of the thread
    they belong to); no null and no failed walk (-1).  A waker dropped for an
    interrupt-context wake-up loses its tid, pid and Python stack, not the kernel stack
    that shows what woke the thread."""
    import pyarrow as pa

    from trainbpf.trace.spool import make_batch
    from trainbpf.tracer.symbols.stacks import drop_irq_wakers, kernel_refs, user_refs

    def ids(values):
        return pa.array(values, type=pa.int32())

    rows = make_batch("offcpu", {
        "ts_ns": np.arange(4, dtype=np.int64), "tid": ids([1, 2, 3, 1]), "pid": ids([10, 11, 12, 10]),
        "kstack_id": ids([3, None, 3, -1]), "peer_kstack_id": ids([None, 9, 40, None]),
        "ustack_id": ids([5, None, -1, 7]), "pystack_id": ids([None, None, None, None]),
        "peer_tid": ids([None, 21, 22, None]), "peer_pid": ids([None, 20, 20, None]),
        "peer_pystack_id": ids([None, 1 << 24, (1 << 24) + 1, None]),
    })
    assert kernel_refs(rows).tolist() == [3, 9, 40]
    assert user_refs(rows).tolist() == [[5, 10], [7, 10]]
    sym = StackSymbolizer(FakeBpf({}))
    sym.irq_ids.add(40)  # stack 40 was taken in interrupt context: row 3's "waker" is whoever was interrupted
    dropped = drop_irq_wakers(rows, sym.irq_id_array())
    column = dropped.schema.get_field_index
    assert dropped.column(column("peer_tid")).to_pylist() == [None, 21, None, None]
    assert dropped.column(column("peer_pid")).to_pylist() == [None, 20, None, None]
    assert dropped.column(column("peer_pystack_id")).to_pylist() == [None, 1 << 24, None, None]
    assert dropped.column(column("peer_kstack_id")).to_pylist() == [None, 9, 40, None]
    assert drop_irq_wakers(rows, StackSymbolizer(FakeBpf({})).irq_id_array()) is rows


def test_a_file_not_held_is_named_from_the_file_mapped(tmp_path, monkeypatch):
    """Beyond MAX_HELD_FILES a file is opened again when its frames are named: through
    its process's map_files while it lives, else by its path only while that is still
    the file mapped.  A container's library has its path inside the container in
    /proc/PID/maps; on the host that path leads to another file (here: another library
    at the path the mapping names), which must never name its frames."""
    import dataclasses
    import shutil

    from trainbpf.tracer.symbols import stacks
    from trainbpf.tracer.symbols.maps import ProcMaps

    lib, host_file = tmp_path / "libmapped.so", tmp_path / "libhost.so"
    shutil.copy("/usr/lib/x86_64-linux-gnu/libz.so.1", lib)
    shutil.copy("/usr/lib/x86_64-linux-gnu/libbz2.so.1.0", host_file)
    addr = ctypes.cast(ctypes.CDLL(str(lib)).zlibVersion, ctypes.c_void_p).value
    mapped = next(m for m in ProcMaps().of(os.getpid()).maps if m.start <= addr < m.end)
    m = dataclasses.replace(mapped, path=str(host_file))  # the path as a container's maps show it to the host
    frame = (*m.file, addr - m.start + m.offset)
    monkeypatch.setattr(stacks, "MAX_HELD_FILES", 0)
    gone = 2 ** 22 + 1  # no such process: the traced one has exited
    for pid, expected in ((os.getpid(), "zlibVersion"), (gone, "[unknown]")):
        files = stacks.MappedFiles()
        try:
            assert files.hold(pid, m)
            assert files.name(frame) == f"{expected} [libhost.so]", pid
        finally:
            files.close()


def test_no_code_asks_bcc_to_name_a_process_address():
    """bcc's per-process lookup closes descriptors it does not own (tracer/symbols/anon.py):
    only kernel addresses (ksym) may be named by bcc in the recorder and the analysis."""
    root = Path(__file__).resolve().parent.parent
    callers = [f"{path.relative_to(root)}:{n}" for folder in ("tracer", "trainbpf", "analyzers", "trace")
               for path in (root / folder).rglob("*.py")
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"\.sym\(|bcc_symcache|SymbolCache\(", line)]
    assert callers == [], callers
