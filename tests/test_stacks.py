"""Naming user stack frames (no BPF: a stand-in for bcc's stack table and symbol lookup,
counting lookups; the maps and files read are this process's and a forked child's, for
real, and bcc's own naming is the reference)."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time

import numpy as np

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
    """bcc's BPF as StackSymbolizer uses it: the stack table and user symbol lookups."""

    def __init__(self, stacks):
        self.table = FakeStackTable(stacks)
        self.lookups: list[tuple[int, int]] = []

    def __getitem__(self, name):
        assert name == "stacks"
        return self.table

    def sym(self, addr, pid, show_module=False):
        self.lookups.append((addr, pid))
        return f"f_{addr:x} [lib]".encode()


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
    own symbols (no bcc lookup), though the worker is gone by then; anonymous code (a
    JIT's) is looked up with bcc per process, at once; an address in no executable
    mapping (a frame-pointer walk gone astray into data) is not looked up at all."""
    libc = ctypes.CDLL(None)
    code = ctypes.cast(libc.getpid, ctypes.c_void_p).value  # libc's text
    data = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    stray = ctypes.addressof(ctypes.c_char.from_buffer(data))
    jit_area = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    jit = ctypes.addressof(ctypes.c_char.from_buffer(jit_area))
    child = forked_child()
    try:
        bpf = FakeBpf({1: [code, jit, stray], 2: [code + 16]})
        sym = StackSymbolizer(bpf)
        assert sym.symbolize([], np.array([(1, os.getpid())])) is None  # placed, not yet named
        sym.symbolize([], np.array([(1, child), (2, child)]))
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    got = names(sym.finish())  # the worker has exited
    sym.close()
    getpid = "getpid [libc.so.6]"
    assert got[(1, os.getpid())] == f"{getpid};f_{jit:x} [lib];0x{stray:x}"
    assert got[(1, child)] == got[(1, os.getpid())]
    assert got[(2, child)].endswith("[libc.so.6]") and got[(2, child)] != f"0x{code + 16:x}"
    assert sorted(bpf.lookups) == sorted([(jit, os.getpid()), (jit, child)])


def test_frames_are_named_as_bcc_names_them():
    """Code addresses of this process, named from the files' symbols (their debug
    files' too), against bcc's own lookup: the same function, or another name for the
    same address (libc exports aliases)."""
    from bcc import BPF  # the recorder's dependency; named on the CPU, no program loaded

    from trainbpf.tracer.symbols.maps import ProcMaps
    from trainbpf.tracer.symbols.stacks import MappedFiles

    index = ProcMaps().of(os.getpid())
    files = MappedFiles()
    rng = np.random.default_rng(7)
    compared = same = 0
    try:
        for m in index.maps:
            if not (m.executable and m.path.startswith("/") and m.file[1] and files.hold(os.getpid(), m)):
                continue
            for addr in rng.integers(m.start, m.end, 20).tolist():
                ours = files.name((*m.file, addr - m.start + m.offset))
                theirs = BPF.sym(addr, os.getpid(), show_module=True).decode(errors="replace")
                compared += 1
                same += ours == theirs
                if ours != theirs:  # an alias (libc exports several names for one function)
                    assert ours.rsplit(" [", 1)[1] == theirs.rsplit(" [", 1)[1], (ours, theirs)
                    assert not ours.startswith("[unknown]") and not theirs.startswith("[unknown]"), (ours, theirs)
    finally:
        files.close()
    assert compared >= 200 and same >= 0.9 * compared, (same, compared)


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
