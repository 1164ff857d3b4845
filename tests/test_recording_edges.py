"""Recording edge cases from issue 15: options refused before anything is compiled (M5),
a thread group followed until its last thread ends (D4), the recorder never tracing
itself (--pid 1), and a killed recording's open intervals and duration (D3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kernel_env import require_root
from trainbpf.trace.errors import EnvironmentCheckError, UsageError
from trainbpf.trace.reader import read_trace
from trainbpf.tracer.record import record
from trainbpf.tracer.record_config import RecordConfig

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINBPF, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=180, **kw)


def one_line_error(res: subprocess.CompletedProcess, code: int, words: str) -> None:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == code and len(lines) == 1, (res.returncode, res.stderr)
    assert lines[0].startswith("trainbpf: error: ") and words in lines[0], lines[0]


# -- M5: bad option values, refused at once ----------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--oncpu-hz", "0"], "--oncpu-hz"),  # was exit 12 "run doctor" after compiling the probes
    (["--oncpu-hz", "-1"], "--oncpu-hz"),
    (["--duration", "nan"], "--duration"),  # was a recording that never stopped
    (["--min-block-us", "-5"], "--min-block-us"),  # were accepted
    (["--min-futex-us", "nan"], "--min-futex-us"),
    (["--min-lock-us", "-1"], "--min-lock-us"),
])
def test_bad_values_are_refused_before_anything_runs(args, words, tmp_path):
    start = time.monotonic()
    res = cli("record", "--pid", str(os.getpid()), "-o", str(tmp_path / "t.parquet"), *args)
    one_line_error(res, UsageError.exit_code, words)
    assert time.monotonic() - start < 20, "refused only after compiling the probes"
    assert not list(tmp_path.iterdir())


def test_gpu_nvml_without_nvml_and_a_foreign_trainer_tid_are_refused(tmp_path):
    require_root()
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        pytest.skip("NVML loads on this machine")
    except Exception:
        pass
    target = subprocess.Popen(["sleep", "30"])
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"), "-d", "1", "--gpu", "nvml")
        one_line_error(res, EnvironmentCheckError.exit_code, "--gpu nvml")  # was: recorded without GPU samples
        res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"), "-d", "1",
                  "--trainer-tid", "1")
        one_line_error(res, UsageError.exit_code, "--trainer-tid 1")  # was: accepted
    finally:
        target.kill()
        target.wait()
    assert not list(tmp_path.iterdir())


# -- D4: a thread group is followed until its last thread ends -------------------------

# The main thread leaves with pthread_exit (the process shows state Zl) while a worker
# works on; after "go" on stdin the worker works WORK seconds, the main thread MAIN.
MAIN_EXITS = r"""
import ctypes, sys, threading, time
work, main = float(sys.argv[1]), float(sys.argv[2])
go = threading.Event()
def worker():
    ctypes.CDLL(None).prctl(15, b"tb_worker", 0, 0, 0)
    go.wait()
    end = time.time() + work
    while time.time() < end:
        time.sleep(0.005)
threading.Thread(target=worker).start()
print("ready", flush=True)
sys.stdin.readline()
go.set()
time.sleep(main)
ctypes.CDLL(None).pthread_exit(None)
"""


def _main_exits(work: float, main: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", MAIN_EXITS, str(work), str(main)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def test_a_process_whose_main_thread_exited_is_recorded(tmp_path):
    require_root()
    proc = _main_exits(30, 0)
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        end = time.time() + 10
        while _state(proc.pid) != "Z":
            assert time.time() < end, "the main thread did not exit"
            time.sleep(0.05)
        result = record(config=RecordConfig(pid=proc.pid, output=tmp_path / "t.parquet", duration=1.5, gpu="off"),
                        handle_signals=False)
    finally:
        proc.kill()
        proc.wait()
    assert result.stop_reason == "duration"  # was TargetError "no such process"
    comms = set(read_trace(tmp_path / "t.parquet").frame("thread")["comm"])
    assert "tb_worker" in comms, comms


def test_recording_follows_the_threads_that_outlive_the_main_thread(tmp_path):
    require_root()
    proc = _main_exits(4, 0.5)
    try:
        def go() -> None:
            proc.stdin.write("go\n")
            proc.stdin.flush()

        result = record(config=RecordConfig(pid=proc.pid, output=tmp_path / "t.parquet", duration=30, gpu="off"),
                        handle_signals=False, on_attached=go)
    finally:
        proc.kill()
        proc.wait()
    # Main exits after 0.5 s, the worker after 4 s: was "target exited" at about 0.5 s.
    assert result.stop_reason == "target exited"
    assert result.duration_s >= 3.5, result.duration_s


@pytest.mark.parametrize("exits", ["before", "during"])
def test_the_thread_that_carries_on_after_pthread_exit_is_the_trainer(tmp_path, exits):
    """Issue 34 item 8: the main thread called pthread_exit (before the recording, or
    during it) while tb_worker carried on the loop.  Was: the dead main thread stayed the
    trainer, shown running 2.25 of 2.25 s, while the live worker slept."""
    require_root()
    proc = _main_exits(30 if exits == "before" else 3, 0 if exits == "before" else 0.5)
    out = tmp_path / "t.parquet"

    def go() -> None:
        proc.stdin.write("go\n")
        proc.stdin.flush()

    try:
        if exits == "before":
            go()
            end = time.time() + 10
            while _state(proc.pid) != "Z":
                assert time.time() < end, "the main thread did not exit"
                time.sleep(0.05)
        record(config=RecordConfig(pid=proc.pid, output=out, duration=2.5 if exits == "before" else 30,
                                   probes=("sched",), gpu="off"),
               handle_signals=False, on_attached=go if exits == "during" else None)
    finally:
        proc.kill()
        proc.wait()
    res = cli("analyze", str(out), "--format", "json")
    assert res.returncode == 0, res.stderr
    threads = {t["tid"]: t for t in json.loads(res.stdout)["threads"]}
    trainer = [t for t in threads.values() if t["role"] == "trainer"]
    assert [t["comm"] for t in trainer] == ["tb_worker"], threads
    main = threads[proc.pid]["seconds"]
    assert main.get("running", 0.0) < (0.05 if exits == "before" else 0.6), main


# -- --pid 1: the recorder never traces itself -----------------------------------------

def test_pid_1_leaves_out_the_recorders_own_process_tree(tmp_path):
    require_root()
    out = tmp_path / "t.parquet"
    rec = subprocess.Popen([TRAINBPF, "record", "--pid", "1", "-d", "1", "--probes", "sched", "--gpu", "off",
                            "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = rec.communicate(timeout=180)
    assert rec.returncode == 0, err
    trace = read_trace(out)
    seen = {int(p) for kind in ("thread", "offcpu", "offcpu_short") for p in trace.frame(kind)["pid"].dropna()}
    assert len(seen) > 1, "--pid 1 traces the machine's processes"
    assert rec.pid not in seen, "the recorder traced itself"


# -- D3: a killed recording's open intervals and its duration --------------------------

def test_a_killed_recording_keeps_blocked_threads_blocked_and_ends_at_its_last_segment(tmp_path):
    require_root()
    target = subprocess.Popen(["sleep", "60"])
    out = tmp_path / "t.parquet"
    spool = tmp_path / "t.parquet.spool"
    rec = subprocess.Popen([TRAINBPF, "record", "--pid", str(target.pid), "--gpu", "off", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.time() + 120
        while not spool.exists():
            assert time.time() < end, "the recorder never started"
            time.sleep(0.05)
        time.sleep(3.5)
        rec.send_signal(signal.SIGKILL)
        killed_at = time.monotonic_ns()
        rec.wait()
    finally:
        for p in (rec, target):
            if p.poll() is None:
                p.kill()
            p.wait()
    trace = read_trace(spool)
    start, stop = trace.meta["clock"]["start_mono_ns"], trace.meta["clock"]["end_mono_ns"]
    # was max(ts + dur) over the rows: vmstat/psi rows carry their interval's end in ts,
    # so the duration ran a flush interval past the last segment, and past the kill
    assert stop <= killed_at, f"the trace ends {(stop - killed_at) / 1e9:.2f} s after the kill"
    assert stop - start >= 2e9
    report = json.loads(cli("analyze", str(spool), "--format", "json").stdout)
    sleeper = next(t for t in report["threads"] if t["tid"] == target.pid)
    seconds = sleeper["seconds"]
    # was "running 5.14 of 5.14 s": the sleep, open at the kill, was never written
    assert seconds.get("running", 0.0) < 0.1, seconds
    assert sum(seconds.values()) - seconds.get("running", 0.0) >= 0.9 * report["trace"]["duration_s"], seconds
    opened = trace.frame("offcpu")
    assert (opened.loc[opened["tid"] == target.pid, "cpu"] == -1).all(), "cut intervals are marked open (cpu -1)"
    # was 65-95 ms later: the spool's start was taken before kallsyms was read, the seed after
    assert opened.loc[opened["tid"] == target.pid, "ts_ns"].min() == start, "the seeded sleep begins at the start"
    assert cli("recover", str(spool)).returncode == 0
    assert read_trace(out).meta["clock"]["end_mono_ns"] == stop
    assert set(read_trace(out).table["kind"].to_pylist()).isdisjoint({"offcpu_open", "segment"})


# -- issue 34 item 6: a malformed library a traced process maps --------------------------

def test_a_process_mapping_a_4_byte_libpython_is_recorded_without_python_frames(tmp_path):
    """The Python-frame reader opens every mapped libpythonX.Y: a 4-byte "\\x7fELF" killed
    the recorder with IndexError (and left a 0-byte spool).  Now that process has no
    Python frames, and says why."""
    require_root()
    fake = tmp_path / "libpython3.11.so"
    fake.write_bytes(b"\x7fELF")
    mapper = tmp_path / "tbmapper"  # a CPython not named python: only the fake is a candidate
    mapper.write_bytes(Path(os.path.realpath(sys.executable)).read_bytes())
    mapper.chmod(0o755)
    proc = subprocess.Popen([str(mapper), "-c", f"import mmap, time; f = open({str(fake)!r}, 'rb'); "
                             "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print('ready', flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    notices: list[str] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        result = record(config=RecordConfig(pid=proc.pid, output=tmp_path / "t.parquet", duration=4.5,
                                            probes=("sched",), gpu="off"),
                        handle_signals=False, notice=notices.append)
    finally:
        proc.kill()
        proc.wait()
    assert result.stop_reason == "duration"
    status = read_trace(tmp_path / "t.parquet").meta["python_frames"]["processes"][str(proc.pid)]
    assert "ELF" in status["status"] and status["version"] == "3.11", status
    assert any(f"process {proc.pid}: native stacks only" in n and "libpython3.11.so" in n for n in notices), notices


# -- M6: bcc never takes its kheaders fallback (sh -c modprobe, stdout noise) ---------

def test_an_empty_bcc_kernel_source_does_not_hide_the_running_kernels_headers(tmp_path, monkeypatch):
    from trainbpf.tracer import kheaders

    (tmp_path / "build" / "include").mkdir(parents=True)
    monkeypatch.setattr(kheaders, "_running_build_dir", lambda: tmp_path / "build")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", "")  # bcc would compile against "" + /include
    assert kheaders.use_headers().exact
    assert "BCC_KERNEL_SOURCE" not in os.environ


def test_an_open_interval_woken_after_the_stop_is_still_blocked():
    """open_intervals reads the maps after taking end_ns: a waking stamped after it came
    after the stop, so the interval has no waker and no run-queue time (never a negative
    one, which the trace reader refuses)."""
    from trainbpf.tracer.collectors.sched import SchedCollector
    from trainbpf.tracer.settings import Settings

    # sched.bpf.c's struct sched_thread: each thread's last switch-out and wake-up
    out = [("ts_ns", "u8"), ("state", "i8"), ("tgid", "u4"), ("kstack_id", "i4"), ("ustack_id", "i4"),
           ("pystack_id", "i4")]
    woken = [("ts_ns", "u8"), ("peer_tid", "u4"), ("peer_pid", "u4"), ("kstack_id", "i4"), ("pystack_id", "i4")]
    blocked, running, never_woken = (1_000_000, 1, 7, -1, -1, -1), (0, 1, 7, -1, -1, -1), (0, 0, 0, -1, -1)
    entries = np.array([
        (blocked, (60_000_000, 8, 8, -1, -1)),  # 7: woken after the stop
        (blocked, (40_000_000, 8, 8, -1, -1)),  # 9: woken before it
        (blocked, never_woken),  # 10
        (blocked, never_woken),  # 11: exited
        (running, (40_000_000, 8, 8, -1, -1)),  # 12: running (ts_ns 0)
    ], dtype=[("out", out), ("woken", woken)])
    batch = SchedCollector(Settings()).open_interval_batches(
        np.array([7, 9, 10, 11, 12], np.uint32), entries, 50_000_000, {7, 9, 10, 12}, "offcpu",
    )[0].to_pandas().set_index("tid")
    assert sorted(batch.index) == [7, 9, 10]
    assert batch.loc[10, "runq_ns"] == 0 and pd.isna(batch.loc[10, "peer_tid"]) and batch.loc[10, "peer_kstack_id"] == -1
    assert batch.loc[7, "runq_ns"] == 0 and pd.isna(batch.loc[7, "peer_tid"])
    assert batch.loc[9, "runq_ns"] == 10_000_000 and batch.loc[9, "peer_tid"] == 8
    assert (batch["dur_ns"] == 49_000_000).all()


# -- the drain loop sleeps until there is work: a stop or the target's exit still ends it at once

def test_a_stop_or_the_targets_exit_ends_the_wait_between_flushes(tmp_path):
    """The recorder sleeps until its next flush (a second away) unless a ring buffer, the
    target's exit or a stop request wakes it: either of the last two must end the
    recording well before that flush would have."""
    require_root()
    for how in ("signal", "exit"):
        target = subprocess.Popen(["sleep", "30"])
        woke: dict[str, int] = {}

        def attached() -> None:
            def later() -> None:
                woke["ns"] = time.monotonic_ns()
                if how == "signal":
                    os.kill(os.getpid(), signal.SIGINT)
                else:
                    target.kill()
            threading.Timer(0.2, later).start()  # the first flush is ~0.8 s later

        try:
            result = record(config=RecordConfig(pid=target.pid, output=tmp_path / f"{how}.parquet", probes=("sched",),
                                                gpu="off"), on_attached=attached)
        finally:
            target.kill()
            target.wait()
        end = read_trace(result.output).meta["clock"]["end_mono_ns"]
        assert result.stop_reason == ("interrupted" if how == "signal" else "target exited"), result.stop_reason
        assert end - woke["ns"] < 400_000_000, f"{how}: stopped {(end - woke['ns']) / 1e6:.0f} ms after it"
