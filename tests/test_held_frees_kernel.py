"""CUDA frees held back by events on real uprobes: one short recording (sched, oncpu,
cuda) of held_free_workloads.py on the stand-in runtime, where tb_held frees each
pinned batch only after its event answered not ready several times and tb_prompt's
events are ready at once.  The report names tb_held's event, its stream and its
queries, and nothing of tb_prompt's.

Needs root (BPF): skips without, fails under CI=true."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from held_free_workloads import BATCH, HANDLES, HELD_QUERIES
from kernel_env import require_root
from recording import record_workload
from report_contract import validate_report
from standins import build_standin
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report
from trainbpf.reports.text import render_text

pytestmark = pytest.mark.kernel

WORKLOAD = Path(__file__).resolve().with_name("held_free_workloads.py")


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    require_root("records a workload with BPF")
    tmp = tmp_path_factory.mktemp("held")
    runtime = build_standin("fake-cuda", tmp / "wheel")
    rec = record_workload(tmp / "trace.parquet", "held_frees", probes=["sched", "oncpu", "cuda"],
                          command=[sys.executable, str(WORKLOAD), str(runtime), "3"])
    report = Report.of(analyze(rec.trace))
    return rec, report


def test_event_calls_are_recorded_with_their_return_and_stream(held):
    rec, _ = held
    calls = rec.trace.view("cuda_call")
    mine = calls[(calls["tid"] == rec.tids["held"]) & (calls["name"] == "cudaEventQuery")]
    assert (mine["state"] == "event").all() and set(mine["ret"]) == {0, 600}, mine[["ret"]].value_counts()
    records = calls[(calls["tid"] == rec.tids["held"]) & (calls["name"] == "cudaEventRecord")]
    assert set(records["stream"]) == {HANDLES["held"][0]}, records["stream"].value_counts()


def test_the_event_that_held_frees_back_is_named(held):
    rec, report = held
    validate_report(report.doc)
    section = report.doc["buffers"]
    stream, first_event = HANDLES["held"]
    mine = [e for e in section["held_back"] if e["tid"] == rec.tids["held"]]
    assert mine, section["held_back"]
    assert {e["event"] for e in mine} <= {first_event + i for i in range(4)} and mine[0]["stream"] == stream, mine
    assert mine[0]["queries"] == HELD_QUERIES * mine[0]["frees"] and mine[0]["memory"] == "cuda_host", mine
    # a query after each 1 ms of CPU: four not-ready queries hold each free 4 ms or more
    assert mine[0]["held_ms"] >= 4 * 1.0 and sum(e["frees"] for e in mine) >= rec.tids["frees"]["held"] - 2, mine
    assert rec.tids["frees"]["held"] >= 40, rec.tids
    text = render_text(report)
    assert f"(recorded on stream {stream:#x}): {HELD_QUERIES} queries over" in text, text
    assert f"by tb_held ({rec.tids['held']}) in release_when_ready (" in text, text
    # the lifetime table: the pinned batches, several alive at once
    [row] = [c for c in section["size_classes"] if c["memory"] == "cuda_host" and c["size_class_bytes"] == BATCH]
    assert row["alive_max"] >= 4 and row["freed"] >= 80, row
    print("\n".join(line for line in text.splitlines() if "held back" in line or "CUDA" in line or "do: release" in line))


def test_events_ready_at_once_hold_nothing_back(held):
    rec, report = held
    assert rec.tids["frees"]["prompt"] >= 40, rec.tids
    assert rec.tids["prompt"] not in {e["tid"] for e in report.doc["buffers"]["held_back"]}
    calls = rec.trace.view("cuda_call")
    queries = calls[(calls["tid"] == rec.tids["prompt"]) & (calls["name"] == "cudaEventQuery")]
    assert len(queries) >= 40 and (queries["ret"] == 0).all(), queries["ret"].value_counts()
