"""Crash safety, clean detach, clear errors for bad input, lost-event accounting, privacy
and big process trees — each against the real recorder and kernel."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kernel_env import require_root, which_or_fail
from recording import record_workload
from trainbpf.errors import (
    EnvironmentCheckError,
    NotRootError,
    OutputError,
    TargetError,
    TraceReadError,
    TraceSchemaError,
    UsageError,
)
from trainbpf.tracefile import read_trace
from trainbpf.tracer.collector import Settings

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))
PROJECT = Path(__file__).resolve().parents[1]
OUR_PROGRAMS = ("tracepoint__", "on_cpu_sample")

# A target that keeps every probe busy: futex hand-offs, sleeps, faults, mmaps.
BUSY_TARGET = r"""
import mmap, queue, sys, threading, time
q = queue.Queue()
def worker():
    while True:
        time.sleep(0.002)
        q.put(1)
threading.Thread(target=worker, daemon=True, name="worker").start()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    q.get()
    m = mmap.mmap(-1, 1 << 20); m[0] = 1; m.close()
"""


def start_target(seconds: float = 60) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUSY_TARGET, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def loaded_program_ids() -> set[int]:
    """Ids of every BPF program loaded in the kernel, as bpftool lists them."""
    bpftool = which_or_fail("bpftool", "bpftool")
    # plain `bpftool prog show` can print nothing on this kernel; -d lists them
    out = subprocess.run([bpftool, "-j", "-d", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["id"] for p in json.loads(out or "[]") if p.get("name", "").startswith(OUR_PROGRAMS)}


def held_program_ids(pid: int) -> set[int]:
    """BPF programs a process holds open (its fdinfo names them), and how many perf
    events it holds, so a test can later check exactly those are gone."""
    ids = set()
    fdinfo = Path(f"/proc/{pid}/fdinfo")
    for entry in fdinfo.iterdir():
        with contextlib.suppress(OSError):
            for line in entry.read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
    return ids


def perf_event_fds(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            n += os.readlink(fd) == "anon_inode:[perf_event]"
    return n


def wait_until_detached(ids: set[int], timeout: float = 5) -> set[int]:
    """Program ids from `ids` still loaded after `timeout` (the kernel frees them lazily)."""
    end = time.time() + timeout
    while (left := ids & loaded_program_ids()) and time.time() < end:
        time.sleep(0.1)
    return left


def wait_for(path: Path, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not path.exists():
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINBPF, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})}, timeout=180, **kw)


def assert_one_line_error(res: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert res.returncode == code, f"exit {res.returncode}, expected {code}: {res.stderr}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got: {res.stderr!r}"
    assert lines[0].startswith("trainbpf: error: ")
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


# -- 1. SIGKILL at a random moment ----------------------------------------------------

def test_sigkill_leaves_a_readable_spool_missing_at_most_2s(tmp_path):
    require_root()
    target = start_target()
    out = tmp_path / "trace.parquet"
    spool = tmp_path / "trace.parquet.spool"
    rec = subprocess.Popen([TRAINBPF, "record", "--pid", str(target.pid), "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(spool)
        time.sleep(random.uniform(2.0, 5.0))
        ours = held_program_ids(rec.pid)
        killed_at = time.monotonic_ns()
        rec.kill()
        rec.wait()
    finally:
        stop(target)
        stop(rec)
    assert not out.exists()
    trace = read_trace(spool)  # the path analyze takes for an unfinished recording
    assert trace.meta["complete"] is False
    off = trace.frame("offcpu")
    assert len(off) > 100
    newest = int(off.ts_ns.max())
    assert killed_at - newest <= 2_000_000_000, f"lost {(killed_at - newest) / 1e9:.2f} s before the kill"
    assert len(ours) >= 30, f"the live recorder held {len(ours)} programs"
    assert wait_until_detached(ours) == set(), "the kernel must drop our programs when the recorder dies"
    res = cli("analyze", str(spool), "--format", "json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["schema"] == "trainbpf.report/1"
    res = cli("recover", str(spool))
    assert res.returncode == 0, res.stderr
    assert read_trace(out).table.num_rows == trace.table.num_rows
    assert not spool.exists()


# -- 2. every way of stopping finalises, exits 0, and detaches ------------------------

@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "duration", "target exit"])
def test_each_stop_finalises_exits_0_and_detaches(tmp_path, how):
    require_root()
    target = start_target()
    out = tmp_path / "trace.parquet"
    args = ["record", "--pid", str(target.pid), "-o", str(out)]
    if how == "duration":
        args += ["--duration", "3"]
    rec = subprocess.Popen([TRAINBPF, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "trace.parquet.spool")
        time.sleep(1)
        ours = held_program_ids(rec.pid)
        assert perf_event_fds(rec.pid) >= 1, "on-CPU sampling holds perf events while recording"
        if how.startswith("SIG"):
            time.sleep(1)
            rec.send_signal(getattr(signal, how))
        elif how == "target exit":  # once attached, however long compiling took
            time.sleep(1)
            target.kill()
            target.wait()
        _, err = rec.communicate(timeout=60)
    finally:
        stop(target)
        stop(rec)
    assert rec.returncode == 0, err
    expected = {"SIGINT": "interrupted", "SIGTERM": "terminated", "duration": "duration",
                "target exit": "target exited"}[how]
    trace = read_trace(out)
    assert trace.meta["complete"] is True
    assert trace.meta["stop_reason"] == expected
    assert len(trace.frame("offcpu")) > 0
    assert len(ours) >= 30
    assert wait_until_detached(ours) == set()


def test_in_process_record_detaches_everything(tmp_path):
    require_root()
    rec = record_workload(tmp_path / "t.parquet", "sleeper", "0.5")
    assert rec.result.stop_reason == "target exited"
    assert held_program_ids(os.getpid()) == set(), "record() returned with BPF programs still open"
    assert perf_event_fds(os.getpid()) == 0, "record() returned with perf events still open"


# -- 3. bad input: one line, distinct exit code, never a traceback --------------------

def test_not_root(tmp_path):
    require_root("switches to an unprivileged user to check the refusal")
    setpriv = which_or_fail("setpriv", "util-linux")
    res = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", TRAINBPF,
                          "record", "--pid", "1", "-o", "/tmp/never.parquet"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert_one_line_error(res, NotRootError.exit_code, "root")


def test_no_such_pid(tmp_path):
    require_root()
    res = cli("record", "--pid", "999999999", "-o", str(tmp_path / "t.parquet"))
    assert_one_line_error(res, TargetError.exit_code, "no such process")


def test_pid_exits_before_attach(tmp_path):
    """A target alive when checked but gone once the probes are compiled (~3 s).  How
    long the CLI takes to start varies with load, so the target's life adapts: too short
    and the pid is already gone ("no such process"), too long and it is recorded."""
    require_root()
    life = 1.0
    for _ in range(6):
        target = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({life})"])
        try:
            res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"))
        finally:
            stop(target)
        if "no such process" in res.stderr:
            life *= 1.6
        elif res.returncode == 0:
            life /= 2
            (tmp_path / "t.parquet").unlink()
        else:
            break
    assert_one_line_error(res, TargetError.exit_code, "exited before the probes attached")
    assert not list(tmp_path.iterdir()), "nothing should be written for a target that never ran"


def test_missing_tracefs_points_at_doctor(tmp_path):
    require_root()
    target = start_target()
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"),
                  env={"TRAINBPF_TRACEFS": str(tmp_path / "no-tracefs")})
    finally:
        stop(target)
    assert_one_line_error(res, EnvironmentCheckError.exit_code, "tracefs", "trainbpf doctor")


def test_missing_headers_point_at_doctor(tmp_path):
    require_root("hides the kernel headers in a private mount namespace")
    unshare = which_or_fail("unshare", "util-linux")
    target = start_target()
    script = ("mount -t tmpfs none /usr/src && mount -t tmpfs none /lib/modules && "
              f"exec {TRAINBPF} record --pid {target.pid} -o {tmp_path / 't.parquet'}")
    try:
        res = subprocess.run([unshare, "-m", "sh", "-c", script], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=120,
                             env={**os.environ, "TRAINBPF_CACHE": str(tmp_path / "cache"),
                                  "BCC_KERNEL_SOURCE": ""})
    finally:
        stop(target)
    assert_one_line_error(res, EnvironmentCheckError.exit_code, "headers", "trainbpf doctor")


def test_missing_bcc_points_at_doctor(tmp_path):
    require_root()
    # a Python path entry whose `bcc` cannot be imported stands for an absent python3-bpfcc
    shadow = tmp_path / "shadow" / "bcc"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named bcc')\n")
    target = start_target()
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"),
                  env={"PYTHONPATH": str(shadow.parent)})
    finally:
        stop(target)
    assert_one_line_error(res, EnvironmentCheckError.exit_code, "bcc", "trainbpf doctor")


def test_output_folder_missing_or_read_only(tmp_path):
    require_root("mounts a read-only tmpfs")
    res = cli("record", "--pid", str(os.getpid()), "-o", str(tmp_path / "nope" / "t.parquet"))
    assert_one_line_error(res, OutputError.exit_code, "does not exist")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(ro)], check=True)
    try:
        res = cli("record", "--pid", str(os.getpid()), "-o", str(ro / "t.parquet"))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert_one_line_error(res, OutputError.exit_code, "not writable")


def test_disk_full_keeps_what_was_written(tmp_path):
    require_root("mounts a small tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "none", str(small)], check=True)
    target = start_target()
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(small / "t.parquet"), "--duration", "60")
        spool = small / "t.parquet.spool"
        assert spool.exists(), "the spool with what was recorded must stay"
        trace = read_trace(spool)
        rows = trace.table.num_rows
    finally:
        stop(target)
        subprocess.run(["umount", str(small)], check=True)
    assert_one_line_error(res, OutputError.exit_code, "disk full", "recover")
    assert rows > 0, "the segments written before the disk filled are readable"


def _write_parquet(path: Path, meta: dict | None) -> None:
    table = pa.table({"kind": ["offcpu"], "ts_ns": [1]})
    if meta is not None:
        table = table.replace_schema_metadata({b"trainbpf": json.dumps(meta).encode()})
    pq.write_table(table, path)


def test_analyze_bad_inputs(tmp_path):
    cases = []
    cases.append((tmp_path / "missing.parquet", TraceReadError, "no such file"))
    (tmp_path / "text.parquet").write_text("hello, not parquet\n")
    cases.append((tmp_path / "text.parquet", TraceReadError, "not a Parquet"))
    (tmp_path / "empty.parquet").write_bytes(b"")
    cases.append((tmp_path / "empty.parquet", TraceReadError, "empty file"))
    _write_parquet(tmp_path / "foreign.parquet", None)
    cases.append((tmp_path / "foreign.parquet", TraceReadError, "not a trainbpf trace"))
    _write_parquet(tmp_path / "other.parquet", {"schema": "someone.else/3"})
    cases.append((tmp_path / "other.parquet", TraceSchemaError, "unknown trace schema"))
    _write_parquet(tmp_path / "newer.parquet", {"schema": "trainbpf.trace/99"})
    cases.append((tmp_path / "newer.parquet", TraceSchemaError, "upgrade trainbpf"))
    _write_parquet(tmp_path / "stacks.parquet", {"schema": "trainbpf.trace/1", "stacks": [1]})
    cases.append((tmp_path / "stacks.parquet", TraceReadError, "'stacks' is not an object"))
    _write_parquet(tmp_path / "walks.parquet", {"schema": "trainbpf.trace/1", "stacks": {"walks": "many"}})
    cases.append((tmp_path / "walks.parquet", TraceReadError, "stacks.walks is not an integer"))
    _write_parquet(tmp_path / "gpu.parquet", {"schema": "trainbpf.trace/1", "gpu": "x"})
    cases.append((tmp_path / "gpu.parquet", TraceReadError, "'gpu' is not an object"))
    good = PROJECT / "tests" / "data" / "small-trace.parquet"
    if good.exists():
        data = good.read_bytes()
        (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2])
        cases.append((tmp_path / "truncated.parquet", TraceReadError, "truncated"))
    for path, exc, words in cases:
        res = cli("analyze", str(path))
        assert_one_line_error(res, exc.exit_code, words)
    assert good.exists(), "tests/data/small-trace.parquet (a real recorded trace) is missing"


def test_truncated_parquet_is_a_clear_error(tmp_path):
    require_root()
    rec = record_workload(tmp_path / "t.parquet", "sleeper", "0.5")
    data = rec.trace.path.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) * 2 // 3])
    res = cli("analyze", str(cut))
    assert_one_line_error(res, TraceReadError.exit_code, "truncated")


def test_bad_record_options():
    for args, words in ((["record"], "--pid"), (["record", "--pid", "1", "--gpu", "cuda"], "--gpu"),
                        (["record", "--pid", "1", "--ringbuf-pages", "3"], "power of two"),
                        (["record", "--pid", "1", "--duration", "0"], "--duration")):
        assert_one_line_error(cli(*args), UsageError.exit_code, words)


# -- 4. lost events are counted and reported -------------------------------------------

def test_tiny_ring_buffer_under_load_records_and_reports_losses(tmp_path):
    require_root()
    target = start_target()
    out = tmp_path / "t.parquet"
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(out), "--duration", "3",
                  "--ringbuf-pages", "1", "--min-block-us", "0", "--min-futex-us", "0", "--oncpu-hz", "5000")
    finally:
        stop(target)
    assert res.returncode == 0, res.stderr
    assert "events lost" in res.stderr
    lost = read_trace(out).meta["lost"]
    assert sum(lost.values()) > 0, lost
    report = cli("analyze", str(out))
    assert report.returncode == 0, report.stderr
    total = sum(lost.values())
    assert "lost" in report.stdout.lower() and str(total) in report.stdout, report.stdout[:2000]


# -- 5. privacy -------------------------------------------------------------------------

def test_trace_is_private_and_owned_by_the_sudo_user(tmp_path):
    require_root("chowns to another user")
    os.chown(tmp_path, 65534, 65534)  # the sudo user must be able to write the folder
    target = start_target()
    out = tmp_path / "t.parquet"
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(out), "--duration", "1",
                  env={"SUDO_UID": "65534", "SUDO_GID": "65534"})
    finally:
        stop(target)
    assert res.returncode == 0, res.stderr
    st = out.stat()
    assert st.st_mode & 0o777 == 0o600
    assert (st.st_uid, st.st_gid) == (65534, 65534)


def test_no_argument_ever_reaches_a_shell():
    offenders = []
    for folder in ("trainbpf", "tracer", "analyzers"):
        for path in (PROJECT / folder).rglob("*.py"):
            text = path.read_text()
            for needle in ("shell=True", "os.system(", "os.popen(", "subprocess.getoutput", "getstatusoutput"):
                if needle in text:
                    offenders.append(f"{path.relative_to(PROJECT)}: {needle}")
    assert offenders == []


def test_shell_metacharacters_in_the_output_name_stay_literal(tmp_path):
    require_root()
    rec_dir = tmp_path / "x"
    rec_dir.mkdir()
    name = "t;touch pwned;$(touch pwned2).parquet"
    target = start_target()
    try:
        res = cli("record", "--pid", str(target.pid), "-o", name, "--duration", "1", cwd=rec_dir)
    finally:
        stop(target)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in rec_dir.iterdir()) == [name]


# -- 7. a big, changing tree ------------------------------------------------------------

BIG_TREE = r"""
import os, sys, threading, time, ctypes
libc = ctypes.CDLL(None)
stop = threading.Event()
def worker(i):
    libc.prctl(15, f"tb_w{i}".encode(), 0, 0, 0)
    while not stop.is_set():
        time.sleep(0.01)
threads = [threading.Thread(target=worker, args=(i,)) for i in range(120)]
for t in threads: t.start()
print("ready", flush=True)
sys.stdin.readline()
children = []
for i in range(10):                      # children forked and exiting during the recording
    pid = os.fork()
    if pid == 0:
        libc.prctl(15, f"tb_child{i}".encode(), 0, 0, 0)
        ts = [threading.Thread(target=time.sleep, args=(0.05,)) for _ in range(5)]
        for t in ts: t.start()
        for t in ts: t.join()
        os._exit(0)
    children.append(pid)
    time.sleep(0.05)
for pid in children: os.waitpid(pid, 0)
late = [threading.Thread(target=worker, args=(200 + i,)) for i in range(20)]   # threads born late
for t in late: t.start()
time.sleep(0.5)
stop.set()
for t in threads + late: t.join()
print(children, flush=True)
"""


def test_100_plus_threads_and_forking_children_all_named(tmp_path):
    require_root()
    proc = subprocess.Popen([sys.executable, "-c", BIG_TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out = tmp_path / "t.parquet"
    try:
        assert proc.stdout.readline().strip() == "ready"
        tids = {int(t) for t in os.listdir(f"/proc/{proc.pid}/task")}
        rec = subprocess.Popen([TRAINBPF, "record", "--pid", str(proc.pid), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for(tmp_path / "t.parquet.spool")
        time.sleep(1.5)  # the spool appears once the probes are live and the tree seeded
        proc.stdin.write("go\n")
        proc.stdin.flush()
        children = json.loads(proc.stdout.readline())
        proc.wait(timeout=60)
        _, err = rec.communicate(timeout=60)
    finally:
        stop(proc)
    assert rec.returncode == 0, err
    trace = read_trace(out)
    threads = trace.frame("thread")
    seen = set(threads.tid)
    assert tids <= seen, f"missing seeded threads: {sorted(tids - seen)[:10]}"
    names = threads.sort_values("ts_ns").groupby("tid").comm.last()
    assert sum(n.startswith("tb_w") for n in names) >= 140, "120 seeded + 20 late workers, all named"
    for i, child in enumerate(children):
        assert f"tb_child{i}" in set(threads[threads.tid == child].comm)
        kids_threads = threads[(threads.pid == child) & (threads.name == "thread")]
        assert len(kids_threads) == 5, f"child {child}: {len(kids_threads)} threads seen"
    assert sum(trace.meta["lost"].values()) == 0
