"""TLB shootdowns (probes/tlb.bpf.c, analyzers/causes/tlb.py): one real recording of a
thread unmapping in a loop on CPU 0 while the trainer spins on CPU 1."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from kernel_env import require_root
from recording import record_workload
from trainbpf.analyzers.causes.tlb import mm_call_counts, shootdown_charges, shootdown_evidence
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, culprits
from trainbpf.reports.text import render_text
from trainbpf.tracer.collectors.tlb import REASON_CODES
from trainbpf.tracer.loader import TRACEFS

WORKLOAD = Path(__file__).with_name("memory_workloads.py")


def test_reason_codes_match_the_tracepoint_format():
    fmt = TRACEFS / "events/tlb/tlb_flush/format"
    if not fmt.exists():
        pytest.skip("no tlb:tlb_flush tracepoint here")
    named = {name: int(code) for code, name in re.findall(r'\{ (\d+), "([^"]+)" \}', fmt.read_text())}
    assert {name: named[name] for name in REASON_CODES} == REASON_CODES


@pytest.fixture(scope="module")
def unmapping(tmp_path_factory):
    require_root()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    out = tmp_path_factory.mktemp("tlb") / "trace.parquet"
    rec = record_workload(out, "", timeout=60, command=[sys.executable, str(WORKLOAD), "tlb_pair", "1.5"])
    return rec, analyze(rec.trace)


def test_shootdowns_on_the_trainers_cpu_are_charged_to_the_unmapping_thread(unmapping):
    rec, analysis = unmapping
    trainer, unmapper = rec.tids["trainer"], rec.tids["unmapper"]
    rows = rec.trace.view("tlb_flush")
    got = rows[(rows["tid"] == trainer) & (rows["side"] == "received")]
    assert got["flushes"].sum() >= 0.3 * rec.tids["munmaps"], (got, rec.tids)  # most munmaps reach CPU 1
    assert set(got["cpu"]) == {1}
    sent = rows[(rows["tid"] == unmapper) & (rows["side"] == "sent")]
    assert sent["flushes"].sum() >= got["flushes"].sum() * 0.9 and set(sent["cpu"]) == {0}
    charges = analysis.shootdowns[analysis.shootdowns["tid"] == trainer].set_index("sender_tid")["shootdowns"]
    assert charges.get(unmapper, 0) >= 0.9 * charges.sum(), charges
    said = shootdown_evidence(analysis.shootdowns, [trainer], {unmapper: "tb_unmapper"}, analysis.mm_calls)
    top = said["tlb_shootdowns"]["senders"][0]
    assert top["tid"] == unmapper and top["comm"] == "tb_unmapper" and top["mm_calls"]["munmap"] >= rec.tids["munmaps"]


def test_the_report_and_the_finding_culprits_name_the_unmapper(unmapping):
    rec, analysis = unmapping
    trainer, unmapper = rec.tids["trainer"], rec.tids["unmapper"]
    report = Report.of(analysis)
    row = next(t for t in report.doc["memory"]["tlb_shootdowns"] if t["tid"] == trainer)
    assert row["senders"][0]["tid"] == unmapper
    assert re.search(rf"was interrupted by [\d,]+ TLB shootdowns; tb_unmapper \({unmapper}\) sent [\d,]+ with its "
                     r"unmaps \(.*munmap", render_text(report))
    evidence = shootdown_evidence(analysis.shootdowns, [trainer], {unmapper: "tb_unmapper"}, analysis.mm_calls)
    blamed = culprits("allocator_churn", [], evidence, pids={}, trainer_tid=trainer)
    assert blamed[0]["tid"] == unmapper and blamed[0]["shootdown_sender"] and blamed[0]["count"] > 0


def test_charges_split_by_bucket_and_process():
    rows = pd.DataFrame({"ts_ns": [0, 0, 0, 0, 100, 100], "tid": [1, 2, 3, 9, 1, 1], "pid": [1, 1, 1, 9, 1, 1],
                         "side": ["received", "sent", "sent", "sent", "received", "sent"],
                         "flushes": [10, 3, 1, 50, 4, 7]})
    charges = shootdown_charges(rows, Span(0, 200))
    assert list(charges.itertuples(index=False, name=None)) == [(1, 2, 1, 8), (1, -1, 1, 4), (1, 3, 1, 2)]
    calls = mm_call_counts(pd.DataFrame({"ts_ns": [1, 2, 300], "tid": [2, 2, 2], "syscall": ["munmap"] * 3}), Span(0, 200))
    said = shootdown_evidence(charges, [1], {2: "loader"}, calls)["tlb_shootdowns"]
    assert said["received"] == 14 and said["unmatched"] == 4
    assert said["senders"][0] == {"tid": 2, "pid": 1, "comm": "loader", "shootdowns": 8, "mm_calls": {"munmap": 2}}
    assert shootdown_evidence(charges, [5], {}, calls) == {}
