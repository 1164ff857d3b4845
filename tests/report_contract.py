"""A validator for the JSON report contract (docs/design.md §Trace contract), shared by the report tests."""

from __future__ import annotations

import json
from typing import Any

from trainbpf.analyzers.causes.categories import CATEGORIES
from trainbpf.analyzers.causes.lifetimes import MEMORY
from trainbpf.analyzers.vocab import ROLES, STATES

TOP_KEYS = {"schema", "trace", "gpu", "starved_s", "host_bound_s", "ranks", "straggler", "findings", "threads", "cuda",
            "traces", "container", "memory", "buffers", "numa"}
NUMA_KEYS = {"gpu_node", "copied_bytes", "bytes_by_node", "remote_bytes", "remote_share", "device_source_bytes",
             "unknown_bytes", "policies", "threads"}
BUFFER_CLASS_KEYS = {"memory", "size_class_bytes", "buffers", "freed", "alive_at_once", "alive_max", "lifetime_s",
                     "lifetime_steps", "maps_per_step", "faults_per_step", "faults_per_s", "map_tid", "unmap_tid"}
HELD_BACK_KEYS = {"pid", "tid", "comm", "function", "memory", "event", "stream", "frees", "queries", "waits", "held_ms"}
CONTAINER_KEYS = {"id", "runtime", "pod_uid", "cgroup"}
TRACE_KEYS = {"path", "duration_s", "pid", "lost_events"}
GPU_KEYS = {"source", "samples", "idle_fraction"}
FINDING_KEYS = {"category", "share", "seconds", "severity", "threads", "chain", "culprits", "summary", "evidence",
                "recommendation", "launch_gap_s"}
CULPRIT_KINDS = {"thread", "process", "file", "device", "peer", "rank", "lock", "cgroup"}
CUDA_KEYS = {"gpu_bound_s", "launch_gap_s", "steps", "threads"}
STEPS_KEYS = {"count", "per_s", "p50_ms", "p99_ms", "host_bound_share", "worst"}
WORST_KEYS = {"tid", "at_s", "step_ms", "host_ms", "gpu_wait_ms", "host_share"}
CUDA_THREAD_KEYS = {"tid", "comm", "launches", "waits", "wait_s", "launch_gap_s"}
SEVERITIES = {"critical", "warning", "info"}


def _plain_json(value: Any) -> None:
    """Only JSON's own types all the way down (no numpy scalars, no NaN)."""
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), k
            _plain_json(v)
    elif isinstance(value, list):
        for v in value:
            _plain_json(v)
    elif isinstance(value, float):
        assert value == value and value not in (float("inf"), float("-inf")), value
    else:
        assert value is None or type(value) in (str, int, bool), (type(value), value)


def validate_report(doc: dict[str, Any]) -> None:
    """Assert that `doc` is exactly a trainbpf.report/3 document."""
    assert set(doc) == TOP_KEYS, set(doc) ^ TOP_KEYS
    assert doc["schema"] == "trainbpf.report/3"
    _plain_json(doc)
    assert json.loads(json.dumps(doc)) == doc

    tr = doc["trace"]
    assert set(tr) == TRACE_KEYS
    assert isinstance(tr["path"], str)
    assert type(tr["duration_s"]) is float and tr["duration_s"] >= 0
    assert tr["pid"] is None or type(tr["pid"]) is int
    assert type(tr["lost_events"]) is int and tr["lost_events"] >= 0

    gpu = doc["gpu"]
    assert set(gpu) == GPU_KEYS
    assert gpu["source"] is None or isinstance(gpu["source"], str)
    assert type(gpu["samples"]) is int and gpu["samples"] >= 0
    if gpu["samples"]:
        assert type(gpu["idle_fraction"]) is float and 0.0 <= gpu["idle_fraction"] <= 1.0
    else:
        assert gpu["idle_fraction"] is None

    assert type(doc["starved_s"]) is float and doc["starved_s"] >= 0
    assert type(doc["host_bound_s"]) is float and 0 <= doc["host_bound_s"] <= doc["starved_s"] + 1e-6
    assert doc["ranks"] is None and doc["straggler"] is None  # a single process
    assert doc["traces"] is None  # one trace
    box = doc["container"]
    assert box is None or (set(box) == CONTAINER_KEYS and isinstance(box["id"], str) and isinstance(box["cgroup"], str)
                           and all(box[k] is None or isinstance(box[k], str) for k in ("runtime", "pod_uid"))), box

    shares = []
    for f in doc["findings"]:
        assert set(f) == FINDING_KEYS, set(f) ^ FINDING_KEYS
        assert f["category"] in CATEGORIES
        assert type(f["share"]) is float and 0.0 <= f["share"] <= 1.0
        assert type(f["seconds"]) is float and f["seconds"] >= 0
        assert f["severity"] in SEVERITIES
        for t in f["threads"]:
            assert set(t) == {"tid", "comm", "role"}
            assert type(t["tid"]) is int and isinstance(t["comm"], str) and t["role"] in ROLES
        for c in f["chain"]:
            assert set(c) == {"tid", "role", "state"}
            assert type(c["tid"]) is int and c["role"] in ROLES and isinstance(c["state"], str) and c["state"]
        for c in f["culprits"]:
            assert c["kind"] in CULPRIT_KINDS and isinstance(c["name"], str), c
            if c["kind"] == "process":  # a task that took the CPU from the finding's threads
                assert set(c) == {"kind", "name", "pid", "tid", "count"}, c
                assert type(c["tid"]) is int and type(c["count"]) is int and c["count"] > 0, c
                assert c["pid"] is None or type(c["pid"]) is int, c
        own = [c["tid"] for c in f["culprits"]
               if c["kind"] == "thread" and not c.get("holder") and not c.get("shootdown_sender")]
        assert own == [t["tid"] for t in f["threads"]]
        assert isinstance(f["summary"], str) and f["summary"]
        assert isinstance(f["evidence"], dict)
        assert isinstance(f["recommendation"], str) and f["recommendation"]
        if doc["cuda"] is None:
            assert f["launch_gap_s"] is None
        else:
            assert type(f["launch_gap_s"]) is float and 0.0 <= f["launch_gap_s"] <= f["seconds"] + 1e-6
        shares.append(f["share"])
    assert shares == sorted(shares, reverse=True), "findings sorted by share, largest first"
    assert sum(shares) <= 1.0 + 1e-9
    assert len({f["category"] for f in doc["findings"]}) == len(doc["findings"])

    for t in doc["threads"]:
        assert set(t) == {"tid", "comm", "role", "seconds"}
        assert type(t["tid"]) is int and isinstance(t["comm"], str) and t["role"] in ROLES
        for state, sec in t["seconds"].items():
            assert state in STATES
            assert type(sec) is float and sec >= 0
    assert len({t["tid"] for t in doc["threads"]}) == len(doc["threads"])
    if doc["cuda"] is not None:
        _validate_cuda(doc["cuda"])
    if doc["memory"] is not None:
        _validate_memory(doc["memory"])
    if doc["buffers"] is not None:
        _validate_buffers(doc["buffers"])
    if doc["numa"] is not None:
        _validate_numa(doc["numa"])


def _validate_numa(numa: dict[str, Any]) -> None:
    """The `numa` section: the bytes copied to the GPU per source page node."""
    assert set(numa) == NUMA_KEYS
    assert numa["copied_bytes"] == sum(numa["bytes_by_node"].values())
    assert numa["remote_share"] is None or 0.0 <= numa["remote_share"] <= 1.0
    for t in numa["threads"]:
        assert set(t) == {"tid", "bytes", "cpus", "mems", "restricted", "ran_on_node"}


def _validate_memory(memory: dict[str, Any]) -> None:
    """The `memory` section: the THP mode and each process's faults per MiB newly mapped."""
    assert set(memory) == {"thp", "processes", "tlb_shootdowns"}
    assert {"enabled", "defrag"} <= set(memory["thp"])
    for p in memory["processes"]:
        assert set(p) == {"pid", "mapped_bytes", "faults", "faults_per_mib", "huge_pages", "faults_with_huge_pages"}
        assert type(p["pid"]) is int and p["mapped_bytes"] > 0 and p["faults"] >= 0
        _nonneg_float(p["faults_per_mib"])
        assert type(p["huge_pages"]) is bool
    for t in memory["tlb_shootdowns"]:
        assert t["received"] > 0 and t["received"] >= sum(s["shootdowns"] for s in t["senders"]), t


def _validate_buffers(section: dict[str, Any]) -> None:
    """The `buffers` section: the lifetime table, a row per size class, largest first."""
    assert set(section) == {"unit", "size_classes", "held_back"} and section["unit"] in ("steps", "seconds"), section
    for e in section["held_back"]:
        assert set(e) == HELD_BACK_KEYS, set(e) ^ HELD_BACK_KEYS
        assert e["memory"] in MEMORY and e["frees"] >= 1 and e["queries"] + e["waits"] >= e["frees"], e
        _nonneg_float(e["held_ms"])
    order = [(MEMORY.index(c["memory"]), -c["size_class_bytes"]) for c in section["size_classes"]]
    assert order == sorted(order) and all(c["size_class_bytes"] & (c["size_class_bytes"] - 1) == 0
                                          for c in section["size_classes"]), order
    for c in section["size_classes"]:
        assert set(c) == BUFFER_CLASS_KEYS, set(c) ^ BUFFER_CLASS_KEYS
        assert 0 <= c["freed"] <= c["buffers"] and 1 <= c["alive_at_once"] <= c["alive_max"], c
        for key in ("lifetime_steps", "maps_per_step", "faults_per_step"):
            _nonneg_float(c[key], nullable=section["unit"] == "seconds" or (key == "lifetime_steps" and not c["freed"]))
        _nonneg_float(c["lifetime_s"], nullable=not c["freed"])


def _nonneg_float(value: Any, nullable: bool = False) -> None:
    assert (nullable and value is None) or (type(value) is float and value >= 0), value


def _validate_cuda(cuda: dict[str, Any]) -> None:
    """The `cuda` section: the trainer's numbers, its steps, one row per CUDA thread."""
    assert set(cuda) == CUDA_KEYS, set(cuda) ^ CUDA_KEYS
    _nonneg_float(cuda["gpu_bound_s"])
    _nonneg_float(cuda["launch_gap_s"])
    st = cuda["steps"]
    assert set(st) == STEPS_KEYS, set(st) ^ STEPS_KEYS
    assert type(st["count"]) is int and st["count"] >= 0
    _nonneg_float(st["per_s"])
    for key in ("p50_ms", "p99_ms", "host_bound_share"):
        _nonneg_float(st[key], nullable=not st["count"])
    if st["count"]:
        assert st["p50_ms"] <= st["p99_ms"] and st["host_bound_share"] <= 1.0
    assert len(st["worst"]) <= st["count"]
    for w in st["worst"]:
        assert set(w) == WORST_KEYS and type(w["tid"]) is int
        for key in WORST_KEYS - {"tid"}:
            _nonneg_float(w[key])
    for t in cuda["threads"]:
        assert set(t) == CUDA_THREAD_KEYS, set(t) ^ CUDA_THREAD_KEYS
        assert type(t["tid"]) is int and isinstance(t["comm"], str)
        assert type(t["launches"]) is int and type(t["waits"]) is int and t["launches"] >= 0 and t["waits"] >= 0
        _nonneg_float(t["wait_s"])
        _nonneg_float(t["launch_gap_s"])
    assert [t["tid"] for t in cuda["threads"]] == sorted({t["tid"] for t in cuda["threads"]})
