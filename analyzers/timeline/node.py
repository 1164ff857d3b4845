"""Node-level values of a recording: run-queue latency and reclaim, compaction and
dirty-throttling time of the traced threads, the machine's PSI and NUMA counters, each
GPU's idle share and the events lost.  `trainbpf health` grades them against its
thresholds (`node_check_values`)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import Span, trace_span
from trainbpf.analyzers.timeline.starvation import gpu_utilisation, idle_fraction

# The row kinds node_values reads (whole frames: each is checked as it is read).
NODE_KINDS = ("offcpu", "offcpu_short", "reclaim", "compaction", "dirty_pause", "psi", "vmstat", "numa_move", "gpu")


def _as_float(values: Any) -> np.ndarray:
    return pd.to_numeric(pd.Series(values), errors="coerce").fillna(0).to_numpy(np.float64)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][min(int(np.searchsorted(cum, q * cum[-1])), len(values) - 1)])


def node_metrics(trace: Any) -> dict[str, Any]:
    """`node_values` of a loaded trace (trainbpf.trace.reader.Trace)."""
    frames = {kind: trace.view(kind) for kind in NODE_KINDS}
    return node_values(frames, span=trace_span(trace.meta, trace.chunks(["ts_ns", "dur_ns"])),
                       recorded_s=trace.duration_ns / 1e9, meta=trace.meta, events=int(trace.num_rows))


def node_values(frames: Mapping[str, pd.DataFrame], *, span: Span, recorded_s: float, meta: Mapping[str, Any],
                events: int) -> dict[str, Any]:
    """Node-level values from the frames of NODE_KINDS (named as Trace.view names them): run-queue latency and
    reclaim/compaction/dirty-throttling time of the traced threads, PSI and NUMA
    counters of the machine, GPU idle share over `span`, lost events (metadata `lost`)
    against the `events` recorded."""
    off, short = frames["offcpu"], frames["offcpu_short"]
    # Long off-CPU intervals carry their own run-queue part; short ones are summed in
    # the kernel, so each sum stands for `count` waits of its mean length.
    short_count = _as_float(short["intervals"])
    short_runq = _as_float(short["runq_ns"])
    long_runq = _as_float(off["runq_ns"])
    values = np.concatenate([long_runq, np.divide(short_runq, short_count, out=np.zeros_like(short_runq), where=short_count > 0)])
    weights = np.concatenate([np.ones_like(long_runq), short_count])

    def total_s(kind: str) -> float:
        return float(_as_float(frames[kind]["dur_ns"]).sum()) / 1e9

    pressure = {}
    for resource, rows in frames["psi"].groupby("resource"):
        span_us = _as_float(rows["dur_ns"]).sum() / 1e3
        if span_us > 0:
            pressure[str(resource)] = min(1.0, float(_as_float(rows["stalled_us"]).sum() / span_us))

    vm = frames["vmstat"]
    vm_sum = pd.Series(_as_float(vm["delta"]), index=vm["key"].astype(str)).groupby(level=0).sum() if len(vm) else pd.Series(dtype=float)
    local, other = float(vm_sum.get("numa_local", 0.0)), float(vm_sum.get("numa_other", 0.0))

    # gpu_utilisation takes the device's rows: rows with a pid are one process's share
    gpu_idle = {}
    for index, rows in frames["gpu"].groupby("index"):
        idle = idle_fraction(gpu_utilisation(rows, span), span)  # 1 - mean utilisation, time-weighted
        if idle is not None:
            gpu_idle[str(int(index))] = idle

    lost = int(sum(int(v) for v in (meta.get("lost") or {}).values()))
    return {
        "recorded_seconds": recorded_s,
        "system_wide": bool(meta.get("system_wide")),
        "runqueue_seconds": float(long_runq.sum() + short_runq.sum()) / 1e9,
        "runqueue_latency_p99_seconds": None if (q := weighted_quantile(values, weights, 0.99)) is None else q / 1e9,
        "runqueue_latency_max_seconds": float(long_runq.max()) / 1e9 if len(long_runq) else None,
        "reclaim_seconds": total_s("reclaim"),
        "compaction_seconds": total_s("compaction"),
        "dirty_throttle_seconds": total_s("dirty_pause"),
        "pressure": pressure,
        "numa_remote_ratio": other / (local + other) if local + other > 0 else None,
        "numa_pages_migrated": float(vm_sum.get("numa_pages_migrated", 0.0)),
        "numa_task_moves": int(len(frames["numa_move"])),
        "gpu_idle_ratio": gpu_idle,
        "lost_events": lost,
        "lost_event_ratio": lost / (lost + events) if lost + events else 0.0,
    }


def node_check_values(node: Mapping[str, Any]) -> dict[str, float | None]:
    """What each node threshold of `trainbpf health` is compared with."""
    recorded = node["recorded_seconds"]

    def per_second(seconds: float) -> float | None:
        return seconds / recorded if recorded > 0 else None

    pressure = node["pressure"]
    return {
        "runqueue_latency_p99_seconds": node["runqueue_latency_p99_seconds"],
        "reclaim_ratio": per_second(node["reclaim_seconds"]),
        "dirty_throttle_ratio": per_second(node["dirty_throttle_seconds"]),
        "cpu_pressure_ratio": pressure.get("cpu.some"),
        "memory_pressure_ratio": pressure.get("memory.some"),
        "io_pressure_ratio": pressure.get("io.some"),
        "numa_remote_ratio": node["numa_remote_ratio"],
        "lost_event_ratio": node["lost_event_ratio"],
    }
