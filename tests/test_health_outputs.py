"""What `trainbpf health` writes: the Prometheus textfile, the JSON document, the top
category, and the atomic 0644 write."""

from __future__ import annotations

import json
import os
import re

from trainbpf.health.config import CRITICAL, DEFAULT_THRESHOLDS, OK, WARNING, HealthConfig
from trainbpf.health.outputs import METRICS, render_textfile, health_document, write_atomic
from trainbpf.health.results import Check, HealthResult, TargetResult
from trainbpf.health.targets import Target

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
