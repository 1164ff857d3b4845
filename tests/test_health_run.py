"""One `trainbpf health` run without the kernel: assessing a recorded trace per target,
the lock, the time limit and its backstop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from synth import healthy, input_pipeline
from trainbpf.health.config import CRITICAL, OK, UNKNOWN, HealthConfig
from trainbpf.health.outputs import health_document, metric_samples
from trainbpf.health.run import HealthBusy, assess, exclusive_lock
from trainbpf.health.targets import Target
from trainbpf.reports.render import run_analyze


def test_assess_grades_each_target_from_the_analysis(tmp_path):
    s = input_pipeline(10.0)
    s.thread(300, "unrelated", pid=300)
    s.offcpu(300, 1.0, 2.0)
    s.thread(201, "pt_data_worker", pid=201, name="process", ts=2.0, parent=200)  # a worker's child, born mid-trace
    s.offcpu(201, 3.0, 1.0)
    path = s.write(tmp_path / "trace.parquet")
    target = Target(100, "python", "python train.py", "device")
    result = assess(trace_path=path, targets=[target], trees={100: ({100, 200}, {100, 200})},
                    config=HealthConfig(), started=time.time() - 12, host="h")
    [t] = result.targets
    assert t.error is None
    report = json.loads(run_analyze(path=path, fmt="json", trainer_tid=100))
    assert t.starved_s == report["starved_s"] > 4.0
    assert t.starved_ratio == pytest.approx(report["starved_s"] / 10.0)
    assert t.status == CRITICAL and result.status == CRITICAL and result.exit_code == 2  # 0.4 <= 0.7
    assert t.top["category"] == "input_pipeline" and result.top_category() == "input_pipeline"
    roles = {role for role, _ in t.role_seconds}
    assert roles == {"trainer", "dataloader"}
    # worker 200 for 10 s and its child 201 from 2 s on; not the unrelated thread 300
    assert sum(v for (r, _), v in t.role_seconds.items() if r == "dataloader") == pytest.approx(10.0 + 8.0, abs=0.2)
    assert result.node["system_wide"] is False and result.mode == "targets"
    assert [c.name for c in result.checks if c.pid == 100] == ["starved_ratio"]
    # one process: no job, so no rank series and no straggler rank (not even -1)
    assert result.job is None and health_document(result)["job"] is None
    assert not [n for n, _, _ in metric_samples(result) if n.startswith("trainbpf_rank_") or n == "trainbpf_straggler_rank"]


def test_assess_reads_the_trace_once_and_gives_each_target_its_own_analysis(tmp_path, monkeypatch):
    """Several targets of one trace: each graded from the same numbers `trainbpf analyze
    --trainer-tid PID --format json` gives, the trace read once for all of them."""
    from trainbpf.trace.reader import Trace

    path = input_pipeline(10.0).write(tmp_path / "trace.parquet")
    reads = []
    real = Trace.__init__
    monkeypatch.setattr(Trace, "__init__", lambda self, *a, **k: reads.append(a) or real(self, *a, **k))
    targets = [Target(100, "python", "python train.py", "pid"), Target(200, "python", "worker", "pid")]
    result = assess(trace_path=path, targets=targets, trees={}, config=HealthConfig(), started=time.time(), host="h")
    assert len(reads) == 1
    monkeypatch.undo()
    for target, graded in zip(targets, result.targets):
        report = json.loads(run_analyze(path=path, fmt="json", trainer_tid=target.pid))
        assert graded.error is None and graded.target == target
        assert graded.starved_s == report["starved_s"]
        assert graded.gpu_idle_fraction == report["gpu"]["idle_fraction"]
        assert graded.findings == [{k: f[k] for k in ("category", "share", "seconds", "severity", "summary")}
                                   for f in report["findings"]]
    # each target is its own trainer: 100 waits for 200's data, 200 only ever runs
    assert [t.top["category"] for t in result.targets] == ["input_pipeline", "host_compute"]


def test_assess_of_a_healthy_run_is_ok_and_a_missing_trainer_is_unknown(tmp_path):
    path = healthy(10.0).write(tmp_path / "trace.parquet")
    ok = assess(trace_path=path, targets=[Target(100, "python", "python", "pid")], trees={}, config=HealthConfig(),
                started=time.time(), host="h")
    # the GPU's 8% idle time: the trainer's brief waits, the rest its own host work
    graded = ok.targets[0]
    assert ok.status == OK and graded.starved_ratio <= 0.081
    assert graded.starved_ratio - graded.host_bound_s / 10.0 < 0.01
    gone = assess(trace_path=path, targets=[Target(4242, "python", "python", "pid")], trees={}, config=HealthConfig(),
                  started=time.time(), host="h")
    assert gone.status == UNKNOWN and gone.targets[0].status == UNKNOWN
    assert gone.error.startswith("pid 4242: ") and "\n" not in gone.error


# -- lock and time limit -----------------------------------------------------------------

def test_second_lock_holder_is_refused(tmp_path):
    lock = tmp_path / "health.lock"
    with exclusive_lock(lock):
        with pytest.raises(HealthBusy, match=rf"pid {os.getpid()}\) holds {re.escape(str(lock))}"):
            with exclusive_lock(lock):
                pass
    with exclusive_lock(lock):  # released
        pass


def test_time_limit_interrupts_a_stuck_step():
    from trainbpf.health.run import CheckTimeout, time_limit

    start = time.monotonic()
    with pytest.raises(CheckTimeout, match="time limit of 0.3 s"):
        with time_limit(0.3, grace_s=30):
            time.sleep(5)
    assert time.monotonic() - start < 2


def test_time_limit_during_a_recording_asks_the_recorder_to_stop():
    """While the recorder's own SIGTERM handler is installed, the limit raises SIGTERM
    (the recorder stops and detaches) instead of an exception."""
    import signal

    from trainbpf.health.run import time_limit

    stopped = []
    with time_limit(0.2, grace_s=30) as expired:
        previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append("terminated"))
        try:
            deadline = time.monotonic() + 5
            while not stopped and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            signal.signal(signal.SIGTERM, previous)
    assert stopped == ["terminated"] and expired.is_set()


BACKSTOP = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from trainbpf.health.run import time_limit
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # the soft stop cannot land
    with time_limit(0.3, grace_s=0.5, on_backstop=lambda: Path(sys.argv[1]).write_text("3")):
        time.sleep(20)
    print("not reached")
""")


def test_backstop_ends_a_run_that_ignores_the_limit(tmp_path):
    marker = tmp_path / "status"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BACKSTOP, str(marker)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - start < 10
    assert marker.read_text() == "3"
    assert "still running" in proc.stderr and "not reached" not in proc.stdout
