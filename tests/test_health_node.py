"""The node-level values of a trace (trainbpf.analyzers.timeline.node) and how `trainbpf health`
grades values, checks and targets."""

from __future__ import annotations

import numpy as np
import pytest

from synth import Synth
from trainbpf.analyzers.causes.categories import CATEGORIES, CHECK_CATEGORY
from trainbpf.analyzers.timeline.node import node_check_values, node_metrics, weighted_quantile
from trainbpf.health.config import CRITICAL, DEFAULT_THRESHOLDS, OK, UNKNOWN, WARNING, Threshold
from trainbpf.health.results import Check, TargetResult, grade, overall_status
from trainbpf.health.targets import Target


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
