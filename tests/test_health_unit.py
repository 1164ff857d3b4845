"""`trainbpf health` without the kernel: config, target choice, node metrics from a
synthetic trace, grading, textfile/JSON writers, lock, time limit, docs and units."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kernel_env import which_or_fail
from synth import Synth, healthy, input_pipeline
from trainbpf.analyzers.categories import CATEGORIES
from trainbpf.errors import TargetError, UsageError
from trainbpf.report import run_analyze
from trainbpf.health import (
    CHECK_CATEGORY,
    CRITICAL,
    DEFAULT_THRESHOLDS,
    METRICS,
    OK,
    UNKNOWN,
    WARNING,
    Check,
    HealthBusy,
    HealthConfig,
    HealthResult,
    Process,
    Target,
    TargetResult,
    Threshold,
    assess,
    choose_targets,
    config_from_mapping,
    exclusive_lock,
    given_targets,
    grade,
    health_config,
    health_document,
    load_config,
    node_check_values,
    node_metrics,
    overall_status,
    recording_root,
    render_textfile,
    scan_processes,
    tree_tids,
    weighted_quantile,
    write_atomic,
)

ROOT = Path(__file__).resolve().parents[1]
TRAINBPF = [sys.executable, "-m", "trainbpf.cli"]
SAMPLE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> dict[tuple[str, tuple], float]:
    """{(metric, sorted label pairs): value} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = tuple(sorted((k, v.encode().decode("unicode_escape")) for k, v in LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


# -- configuration -----------------------------------------------------------------------

def test_example_config_spells_out_the_defaults():
    config = load_config(ROOT / "scripts/trainbpf-health.toml")
    defaults = HealthConfig()
    differs = {f.name for f in dataclasses.fields(HealthConfig) if getattr(config, f.name) != getattr(defaults, f.name)}
    assert differs == {"textfile_dir", "json_file"}
    assert config.limit_s == defaults.duration_s + 60


def test_config_overrides_thresholds_partially_and_inf_turns_a_level_off():
    config = config_from_mapping({"duration_s": 3, "thresholds": {"starved_ratio": {"critical": math.inf},
                                                                  "reclaim_ratio": {"warning": 0.2, "critical": 0.3}}}, source="t")
    assert config.duration_s == 3.0 and config.limit_s == 63.0
    assert config.thresholds["starved_ratio"] == Threshold(0.2, math.inf)
    assert config.thresholds["reclaim_ratio"] == Threshold(0.2, 0.3)
    assert config.thresholds["io_pressure_ratio"] == DEFAULT_THRESHOLDS["io_pressure_ratio"]
    assert grade(10.0, config.thresholds["starved_ratio"]) == WARNING


@pytest.mark.parametrize("raw, message", [
    ({"duraton_s": 3}, "unknown key"),
    ({"duration_s": "ten"}, "expected a number"),
    ({"duration_s": 0}, "duration_s must be positive"),
    ({"time_limit_s": -1}, "time_limit_s must be positive"),
    ({"gpu": "cuda"}, "choose auto"),
    ({"command_patterns": "torchrun"}, "list of regular expressions"),
    ({"command_patterns": ["(torchrun"]}, "bad regular expression"),
    ({"thresholds": {"starved": {"warning": 1}}}, "unknown threshold"),
    ({"thresholds": {"starved_ratio": {"warning": 0.6, "critical": 0.5}}}, "above critical"),
    ({"thresholds": {"starved_ratio": 0.5}}, "warning = N"),
    ({"lock_file": ""}, "expected a path"),
    ({"duration_s": float("inf")}, "at most 86400"),  # issue 15 M3: was two OverflowError tracebacks
    ({"time_limit_s": 1e12}, "at most"),
    ({"thresholds": {"starved_ratio": {"warning": -0.5}}}, "not negative"),  # M5: was accepted
])
def test_bad_config_is_one_line_usage_error(raw, message):
    with pytest.raises(UsageError, match=message) as err:
        config_from_mapping(raw, source="config x.toml")
    assert "\n" not in str(err.value)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("duration_s = [\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(UsageError, match="No such file"):
        load_config(tmp_path / "missing.toml")


def test_command_line_wins_over_config(tmp_path):
    path = tmp_path / "h.toml"
    path.write_text('duration_s = 30\njson_file = "/nowhere/h.json"\n')
    config = health_config(config_file=path, duration=2, pids=[5, 7], json_file=tmp_path / "x.json")
    assert (config.duration_s, config.pids, config.json_file) == (2.0, (5, 7), tmp_path / "x.json")
    with pytest.raises(UsageError, match="duration_s must be positive"):
        health_config(config_file=path, duration=-1)


# -- target selection --------------------------------------------------------------------

def _procs(*rows) -> dict[int, Process]:
    return {r[0]: Process(*r) for r in rows}


NODE = _procs(
    (1, 0, "systemd", "/sbin/init", False),
    (50, 1, "nvidia-persiste", "/usr/bin/nvidia-persistenced --user nvidia", True),
    (100, 1, "torchrun", "/usr/bin/python3 /usr/local/bin/torchrun --nproc-per-node 2 train.py", False),
    (101, 100, "python3", "/usr/bin/python3 -u train.py --local-rank 0", True),
    (102, 100, "python3", "/usr/bin/python3 -u train.py --local-rank 1", True),
    (103, 101, "pt_data_worker", "/usr/bin/python3 -u train.py --local-rank 0", True),  # forked: inherited fds
    (200, 1, "bash", "bash", False),
    (201, 200, "python3", "python3 -m torch.distributed.run --standalone cpu_train.py", False),
    (202, 201, "python3", "python3 cpu_train.py", False),
    (300, 1, "kworker/0:1", "", True),
    (400, 1, "sshd", "sshd: admin", False),
    (401, 400, "vim", "vim torchrunner.py", False),  # no word-bounded match
)


def test_ranks_are_the_topmost_device_holders_and_launchers_fold_into_them():
    targets = choose_targets(NODE, command_patterns=HealthConfig().command_patterns,
                             exclude_patterns=HealthConfig().exclude_patterns, skip=set())
    assert [(t.pid, t.reason) for t in targets] == [(101, "device"), (102, "device"), (201, "pattern")]


def test_the_check_itself_and_its_parents_are_never_targets():
    targets = choose_targets(NODE, command_patterns=(r"torch",), exclude_patterns=(), skip={400, 401})
    assert 401 not in {t.pid for t in targets}
    assert 50 in {t.pid for t in targets}, "without exclude patterns the daemon counts"


def test_given_pids_must_exist():
    assert [t.pid for t in given_targets(NODE, (102, 101, 102))] == [102, 101]
    with pytest.raises(TargetError, match="no such process: 999"):
        given_targets(NODE, (101, 999))


@pytest.mark.parametrize("pids, root", [([101], 101), ([101, 102], 100), ([103, 102], 100), ([101, 201], None), ([], None)])
def test_recording_root_is_the_deepest_common_ancestor(pids, root):
    assert recording_root(NODE, pids) == root


def test_scan_finds_a_holder_of_a_device_file(tmp_path):
    device = tmp_path / "fake-nvidia0"
    device.write_text("")
    with open(device) as held:
        procs = scan_processes(device_glob=str(tmp_path / "fake-nvidia*"))
        assert procs[os.getpid()].holds_device
        assert held.fileno() >= 0
    assert not any(p.holds_device for pid, p in procs.items() if pid != os.getpid())
    assert not scan_processes(device_glob=str(tmp_path / "nothing*"))[os.getpid()].holds_device


# -- node metrics and grading ------------------------------------------------------------

def test_weighted_quantile():
    values = np.array([1.0, 100.0])
    assert weighted_quantile(values, np.array([99.0, 1.0]), 0.99) == 1.0
    assert weighted_quantile(values, np.array([98.0, 2.0]), 0.99) == 100.0
    assert weighted_quantile(values, np.array([0.0, 0.0]), 0.99) is None


def node_trace(tmp_path):
    s = Synth(duration_s=10.0, meta={"system_wide": True, "lost": {"sched": 5}})
    s.thread(100, "python")
    # 98 short waits averaging 10 us, plus two long off-CPU intervals with 20 and 40 ms queued
    s.offcpu_short(100, 5.0, dur=0.01, count=98, runq=98 * 10e-6)
    s.offcpu(100, 1.0, 0.05, runq=0.02)
    s.offcpu(100, 2.0, 0.05, state="R", runq=0.04)
    s.reclaim(100, 3.0, 0.2)
    s.compaction(100, 3.5, 0.1)
    s.dirty_pause(100, 4.0, 0.3)
    s.numa_move(100, 4.5, cpu=1, src=0, dst=1)
    for ts in (5.0, 10.0):
        s.add("psi", ts_ns=int(1e12 + ts * 1e9), dur_ns=int(5e9), name="cpu.some", count=2_500_000)
        s.add("psi", ts_ns=int(1e12 + ts * 1e9), dur_ns=int(5e9), name="memory.some", count=0)
    s.add("vmstat", ts_ns=int(1e12 + 5e9), dur_ns=int(5e9), name="numa_local", count=600)
    s.add("vmstat", ts_ns=int(1e12 + 10e9), dur_ns=int(5e9), name="numa_local", count=300)
    s.add("vmstat", ts_ns=int(1e12 + 10e9), dur_ns=int(5e9), name="numa_other", count=100)
    for i in range(10):
        s.gpu(i + 0.5, 5.0 if i < 3 else 90.0)
    return s.read(tmp_path)


def test_node_metrics_from_a_trace(tmp_path):
    node = node_metrics(node_trace(tmp_path))
    assert node["recorded_seconds"] == pytest.approx(10.0)
    assert node["system_wide"] is True
    assert node["runqueue_seconds"] == pytest.approx(0.06 + 98 * 10e-6)
    assert node["runqueue_latency_p99_seconds"] == pytest.approx(0.02)  # 99th of 100 waits
    assert node["runqueue_latency_max_seconds"] == pytest.approx(0.04)
    assert (node["reclaim_seconds"], node["compaction_seconds"], node["dirty_throttle_seconds"]) == pytest.approx((0.2, 0.1, 0.3))
    assert node["pressure"] == pytest.approx({"cpu.some": 0.5, "memory.some": 0.0})
    assert node["numa_remote_ratio"] == pytest.approx(0.1)
    assert node["numa_task_moves"] == 1
    # Time-weighted: samples at 0.5, 1.5, .. 9.5 s cover [0, 9.5); 2.5 s at 5%, 7 s at 90%.
    assert node["gpu_idle_ratio"] == pytest.approx({"0": (2.5 * 0.95 + 7 * 0.10) / 9.5})
    assert node["lost_events"] == 5
    values = node_check_values(node)
    assert values["reclaim_ratio"] == pytest.approx(0.02) and values["dirty_throttle_ratio"] == pytest.approx(0.03)
    assert values["io_pressure_ratio"] is None  # not measured: not graded
    assert set(values) | {"starved_ratio"} == set(DEFAULT_THRESHOLDS)


def test_node_metrics_of_an_empty_trace(tmp_path):
    node = node_metrics(Synth(duration_s=2.0).read(tmp_path))
    assert node["runqueue_latency_p99_seconds"] is None and node["runqueue_seconds"] == 0.0
    assert node["numa_remote_ratio"] is None and node["pressure"] == {}


@pytest.mark.parametrize("value, status", [(None, OK), (0.1, OK), (0.25, WARNING), (0.49, WARNING), (0.5, CRITICAL), (7, CRITICAL)])
def test_grade(value, status):
    assert grade(value, Threshold(0.25, 0.5)) == status


def test_overall_status_is_3_when_anything_could_not_be_checked():
    th = Threshold(1, 2)
    crit = [Check("x", 5, th, CRITICAL)]
    assert overall_status([], [], None) == OK
    assert overall_status([Check("x", 1, th, WARNING), Check("y", 0, th, OK)], [], None) == WARNING
    assert overall_status(crit, [], None) == CRITICAL
    assert overall_status(crit, [], "recording failed") == UNKNOWN
    broken = TargetResult(Target(1, "python", "python", "pid"), error="pid 1: analysis failed")
    assert overall_status(crit, [broken], None) == UNKNOWN


def test_every_node_check_points_at_a_known_category():
    assert set(CHECK_CATEGORY.values()) <= set(CATEGORIES)


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


def test_assess_of_a_healthy_run_is_ok_and_a_missing_trainer_is_unknown(tmp_path):
    path = healthy(10.0).write(tmp_path / "trace.parquet")
    ok = assess(trace_path=path, targets=[Target(100, "python", "python", "pid")], trees={}, config=HealthConfig(),
                started=time.time(), host="h")
    assert ok.status == OK and ok.targets[0].starved_ratio < 0.05
    gone = assess(trace_path=path, targets=[Target(4242, "python", "python", "pid")], trees={}, config=HealthConfig(),
                  started=time.time(), host="h")
    assert gone.status == UNKNOWN and gone.targets[0].status == UNKNOWN
    assert gone.error.startswith("pid 4242: ") and "\n" not in gone.error


def test_tree_tids_follows_processes_born_during_the_trace(tmp_path):
    s = Synth(duration_s=5.0)
    s.thread(10, "trainer", pid=10)
    s.thread(11, "worker-thread", pid=10, name="thread", ts=1.0, parent=10)
    s.thread(20, "child", pid=20, name="process", ts=2.0, parent=11)
    s.thread(21, "child-thread", pid=20, name="thread", ts=3.0, parent=20)
    s.thread(30, "stranger", pid=30, name="process", ts=2.0, parent=1)
    threads = s.read(tmp_path).frame("thread")
    assert tree_tids(threads, pids={10}, tids={10}) == {10, 11, 20, 21}
    assert tree_tids(threads, pids={30}, tids=set()) == {30}


# -- outputs -----------------------------------------------------------------------------

def sample_result() -> HealthResult:
    target = TargetResult(Target(4242, 'py "odd"\\name', "python train.py", "device"), status=CRITICAL, starved_s=6.0,
                          starved_ratio=0.6, gpu_idle_fraction=0.7,
                          findings=[{"category": "input_pipeline", "share": 0.75, "seconds": 4.5, "severity": "critical", "summary": "s"},
                                    {"category": "cpu_contention", "share": 0.2, "seconds": 1.2, "severity": "warning", "summary": "s"}],
                          role_seconds={("trainer", "futex"): 5.0, ("dataloader", "running"): 9.5})
    node = {"recorded_seconds": 10.0, "system_wide": False, "runqueue_seconds": 1.5, "runqueue_latency_p99_seconds": 0.004,
            "runqueue_latency_max_seconds": 0.03, "reclaim_seconds": 0.0, "compaction_seconds": 0.0, "dirty_throttle_seconds": 0.5,
            "pressure": {"cpu.some": 0.25, "io.full": 0.01}, "numa_remote_ratio": None, "numa_pages_migrated": 0.0,
            "numa_task_moves": 0, "gpu_idle_ratio": {"0": 0.7, "1": 0.1}, "lost_events": 0, "lost_event_ratio": 0.0}
    th = DEFAULT_THRESHOLDS
    checks = [Check("starved_ratio", 0.6, th["starved_ratio"], CRITICAL, 4242),
              Check("dirty_throttle_ratio", 0.05, th["dirty_throttle_ratio"], CRITICAL),
              Check("lost_event_ratio", 0.0, th["lost_event_ratio"], OK),
              Check("numa_remote_ratio", None, th["numa_remote_ratio"], OK)]
    return HealthResult(CRITICAL, "node-7", 1_800_000_000.0, 1_800_000_012.5, "targets", [target], node, checks, None, HealthConfig())


def test_textfile_has_help_and_type_once_per_family_and_escaped_labels():
    text = render_textfile(sample_result())
    families = re.findall(r"^# TYPE (\w+) gauge$", text, re.M)
    assert len(families) == len(set(families))
    assert set(re.findall(r"^# HELP (\w+) ", text, re.M)) == set(families) <= set(METRICS)
    for name in families:  # each family's samples follow its HELP/TYPE lines
        block = text.split(f"# TYPE {name} gauge\n", 1)[1].split("# HELP", 1)[0]
        assert block.strip() and all(line.startswith(name) for line in block.strip().splitlines())
    samples = parse_exposition(text)
    assert samples[("trainbpf_health_status", ())] == 2
    assert samples[("trainbpf_health_run_seconds", ())] == 12.5
    assert samples[("trainbpf_target_info", (("comm", 'py "odd"\\name'), ("pid", "4242"), ("reason", "device")))] == 1
    assert samples[("trainbpf_target_starved_ratio", (("pid", "4242"),))] == 0.6
    assert samples[("trainbpf_finding_share_ratio", (("category", "input_pipeline"), ("pid", "4242")))] == 0.75
    assert samples[("trainbpf_thread_state_seconds", (("pid", "4242"), ("role", "dataloader"), ("state", "running")))] == 9.5
    assert samples[("trainbpf_node_pressure_ratio", (("kind", "some"), ("resource", "cpu")))] == 0.25
    assert samples[("trainbpf_gpu_idle_ratio", (("gpu", "1"),))] == 0.1
    assert samples[("trainbpf_health_check_status", (("check", "dirty_throttle_ratio"),))] == 2
    assert ("trainbpf_health_check_value", (("check", "numa_remote_ratio"),)) not in samples  # unmeasured
    assert ("trainbpf_node_numa_remote_ratio", ()) not in samples
    assert not any(k[0] == "trainbpf_health_check_value" and ("check", "starved_ratio") in k[1] for k in samples)


def test_json_document():
    doc = health_document(sample_result())
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc
    assert (doc["schema"], doc["status"], doc["exit_code"], doc["host"]) == ("trainbpf.health/1", "critical", 2, "node-7")
    assert (doc["starved_ratio"], doc["top_category"]) == (0.6, "input_pipeline")
    assert doc["finished"] == "2027-01-15T08:00:12Z"
    lost = next(c for c in doc["checks"] if c["check"] == "lost_event_ratio")
    assert lost["critical"] is None and lost["status"] == "ok"


def test_top_category_without_targets_is_the_worst_node_check():
    result = sample_result()
    result.targets = []
    th = DEFAULT_THRESHOLDS
    result.checks = [Check("io_pressure_ratio", 0.3, th["io_pressure_ratio"], WARNING),
                     Check("reclaim_ratio", 0.06, th["reclaim_ratio"], CRITICAL),
                     Check("lost_event_ratio", 0.5, th["lost_event_ratio"], WARNING)]
    assert result.top_category() == "memory_reclaim"
    result.checks = [Check("reclaim_ratio", 0.0, th["reclaim_ratio"], OK)]
    assert result.top_category() is None


def test_atomic_write_is_0644_whatever_the_umask_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "trainbpf_health.prom"
    target.write_text("old\n")
    old = os.umask(0o077)
    try:
        write_atomic(target, "new\n")
    finally:
        os.umask(old)
    assert target.read_text() == "new\n"
    assert (target.stat().st_mode & 0o777) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["trainbpf_health.prom"]


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
    from trainbpf.health import CheckTimeout, time_limit

    start = time.monotonic()
    with pytest.raises(CheckTimeout, match="time limit of 0.3 s"):
        with time_limit(0.3, grace_s=30):
            time.sleep(5)
    assert time.monotonic() - start < 2


def test_time_limit_during_a_recording_asks_the_recorder_to_stop():
    """While the recorder's own SIGTERM handler is installed, the limit raises SIGTERM
    (the recorder stops and detaches) instead of an exception."""
    import signal

    from trainbpf.health import time_limit

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
    from trainbpf.health import time_limit
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


# -- command line ------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--duration", "abc"], "--duration"),
    (["--duration", "-2"], "duration_s must be positive"),
    (["--duration", "1e12", "--pid", "1"], "at most 86400"),  # M3: OverflowError tracebacks, "no targets"
    (["--duration", "nan"], "duration_s must be positive"),
    (["--bogus"], "No such option"),
    (["--config", "/nonexistent/health.toml"], "No such file"),
    (["--textfile-dir", "/nonexistent/dir"], "textfile folder /nonexistent/dir does not exist"),
])
def test_bad_input_exits_3_with_a_message(args, message, tmp_path):
    proc = subprocess.run([*TRAINBPF, "health", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert message in proc.stderr


def test_wrapper_passes_arguments_and_the_exit_code(tmp_path):
    env = {**os.environ, "TRAINBPF": f"{ROOT}/.venv/bin/trainbpf", "TRAINBPF_HEALTH_ARGS": "--duration -1"}
    proc = subprocess.run([ROOT / "scripts/trainbpf-health"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3 and "duration_s must be positive" in proc.stderr
    env["TRAINBPF"] = str(tmp_path / "missing")
    proc = subprocess.run([ROOT / "scripts/trainbpf-health"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3 and "trainbpf not found" in proc.stderr


# -- docs and units ----------------------------------------------------------------------

def test_docs_list_every_metric_threshold_and_config_key():
    doc = (ROOT / "docs/health.md").read_text()
    for name, help_text in METRICS.items():
        assert re.search(rf"^\| `{name}` \|[^|]*\| {re.escape(help_text)} \|$", doc, re.M), name
    for name, th in DEFAULT_THRESHOLDS.items():
        assert re.search(rf"^\| `{name}` \| {th.warning:g} \| {th.critical:g} \|", doc, re.M), name
    from trainbpf.health import CONFIG_KEYS

    for key in CONFIG_KEYS:
        assert re.search(rf"^\| `\[?{key}\]?` \|", doc, re.M), key


def test_systemd_units_verify(tmp_path):
    exe = which_or_fail("systemd-analyze", "systemd")
    units = ROOT / "scripts/systemd"
    service = (units / "trainbpf-health.service").read_text()
    assert "SuccessExitStatus=1 2" in service
    # verify checks that ExecStart exists: point it at this checkout's wrapper
    (tmp_path / "trainbpf-health.service").write_text(service.replace("/usr/local/sbin/trainbpf-health", str(ROOT / "scripts/trainbpf-health")))
    (tmp_path / "trainbpf-health.timer").write_text((units / "trainbpf-health.timer").read_text())
    proc = subprocess.run([exe, "verify", tmp_path / "trainbpf-health.service", tmp_path / "trainbpf-health.timer"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    docs = (ROOT / "docs/health.md").read_text()
    for unit in ("trainbpf-health.service", "trainbpf-health.timer"):
        body = "\n".join(line for line in (units / unit).read_text().splitlines() if not line.startswith("#"))
        assert body.strip() in docs, f"docs/health.md shows an outdated {unit}"
