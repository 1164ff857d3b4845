"""Buffer lifetimes on a real kernel: a step loop that holds its last 8 mmap'd 8 MiB
batches is an allocator_churn finding of the freed_late case that names the holding
thread and its depth; the same loop unmapping each batch at once is not.  Two short
recordings (sched, oncpu, faults and mm probes).

Needs root (BPF): skips without, fails under CI=true."""

from __future__ import annotations

import pytest

from kernel_env import require_root
from recording import record_workload
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report

pytestmark = pytest.mark.kernel

PROBES = ["sched", "oncpu", "faults", "mm"]
BATCH = 8 << 20


def churn_finding(tmp_path, depth: int):
    rec = record_workload(tmp_path / "trace.parquet", "held_batches", depth, "3", probes=PROBES)
    report = Report.of(analyze(rec.trace))
    found = [f for f in report.doc["findings"] if f["category"] == "allocator_churn"]
    return rec, report, found[0] if found else None


def test_held_batches_are_named_with_their_holder_and_depth(tmp_path):
    require_root("records a workload with BPF")
    rec, report, f = churn_finding(tmp_path, 8)
    assert f is not None, [(x["category"], x["share"]) for x in report.doc["findings"]]
    assert f["evidence"].get("case") == "freed_late", f["evidence"]
    held, holder = f["evidence"]["held_buffers"], rec.tids["holder"]
    assert held["size_class"] == BATCH and held["alive_at_once"] == 8, held
    assert held["map_tid"] == holder and held["unmap_tid"] == holder, held
    assert "8 MiB buffers" in f["summary"] and "(8 alive at once)" in f["summary"], f["summary"]
    assert f"mapped by tb_holder ({holder})" in f["summary"], f["summary"]
    assert "keep a pool of 8 buffers" in f["recommendation"], f["recommendation"]
    print(f["summary"])


def test_batches_unmapped_at_once_are_not_freed_late(tmp_path):
    require_root("records a workload with BPF")
    _, report, f = churn_finding(tmp_path, 0)
    # (its 4 KiB pages may still make it the small_pages case)
    assert f is None or f["evidence"].get("case") != "freed_late", f["evidence"]
    [row] = [c for c in report.doc["buffers"]["size_classes"] if c["size_class_bytes"] == BATCH]
    assert row["alive_max"] == 1 and row["buffers"] >= 50, row
