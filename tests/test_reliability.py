"""Crash safety, clean detach and clear errors for bad input, each against the real
recorder and kernel (lost events, privacy and big trees: test_reliability_load.py)."""

from __future__ import annotations

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
from reliability_env import (
    PROJECT,
    TRAINBPF,
    assert_one_line_error,
    cli,
    held_program_ids,
    perf_event_fds,
    start_target,
    stop,
    wait_for,
    wait_until_detached,
)
from trainbpf.trace.errors import (
    EnvironmentCheckError,
    NotRootError,
    OutputError,
    TargetError,
    TraceReadError,
    TraceSchemaError,
    UsageError,
)
from trainbpf.trace.reader import read_trace


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
    assert json.loads(res.stdout)["schema"] == "trainbpf.report/3"
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
        # A time no CLOCK_MONOTONIC reaches (sums of such would overflow int64 further on).
        table = pq.read_table(good)
        ts = table["ts_ns"].to_pylist()
        ts[0] = 2**63 - 1
        far = table.set_column(table.schema.get_field_index("ts_ns"), "ts_ns", pa.array(ts, table.schema.field("ts_ns").type))
        pq.write_table(far, tmp_path / "far.parquet")
        cases.append((tmp_path / "far.parquet", TraceReadError, "beyond any clock reading"))
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


def test_detach_survives_a_perf_event_already_closed():
    """A tracepoint whose perf event descriptor something else closed is already
    detached: loader.detach() lets every other program go and does not raise (bcc alone
    retried the close, failed on EBADF and kept the rest attached)."""
    require_root()
    from trainbpf.tracer import loader
    from trainbpf.tracer.settings import Settings

    before = held_program_ids(os.getpid())
    settings = Settings()
    bpf = loader.load(loader.select(["sched", "futex"], settings), settings)
    assert held_program_ids(os.getpid()) - before, "the probes should hold programs"
    tp, fd = next(iter(bpf.tracepoint_fds.items()))
    os.close(fd)  # gone behind bcc's back
    loader.detach(bpf)
    assert held_program_ids(os.getpid()) - before == set(), f"programs left after closing {tp!r} early"
    assert not bpf.tracepoint_fds


def test_detach_passes_over_a_program_descriptor_already_closed():
    """bcc's cleanup closes every program's descriptor and raises on one already closed
    (the trace is written by then): detach leaves such a program out, closes the rest."""
    import types

    from trainbpf.tracer import loader

    gone, held = os.open("/dev/null", os.O_RDONLY), os.open("/dev/null", os.O_RDONLY)
    os.close(gone)
    bpf = types.SimpleNamespace(tracepoint_fds={}, uprobe_fds={},
                                funcs={"gone": types.SimpleNamespace(fd=gone), "held": types.SimpleNamespace(fd=held)})
    bpf.cleanup = lambda: [os.close(fn.fd) for fn in bpf.funcs.values()]  # as bcc's close() does
    loader.detach(bpf)
    assert list(bpf.funcs) == ["held"]
    with pytest.raises(OSError):
        os.fstat(held)  # closed by the cleanup
