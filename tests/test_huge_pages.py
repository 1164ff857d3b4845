"""Huge pages (analyzers/causes/huge_pages.py): the THP mode in the trace's metadata and
each process's faults per MiB newly mapped, from one real recording of the same mmap
churn with MADV_HUGEPAGE (this process) and MADV_NOHUGEPAGE (its child)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from kernel_env import require_root
from recording import record_workload
from trainbpf.analyzers.causes.huge_pages import page_evidence, process_pages, thp_state
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, finding_summary, recommendation
from trainbpf.reports.html import render_html
from trainbpf.reports.text import render_text
from trainbpf.tracer.samplers.procfs import thp_mode

WORKLOAD = Path(__file__).with_name("memory_workloads.py")
ROUNDS = 12
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.fixture(scope="module")
def churned(tmp_path_factory):
    require_root()
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    out = tmp_path_factory.mktemp("thp") / "trace.parquet"
    rec = record_workload(out, "", timeout=90,
                          command=[sys.executable, str(WORKLOAD), "thp_pair", str(ROUNDS)])
    return rec, analyze(rec.trace)


def test_thp_mode_is_in_the_metadata(churned):
    rec, _ = churned
    assert rec.trace.meta["thp"] == thp_mode()
    assert rec.trace.meta["thp"]["enabled"] in ("always", "madvise")


def test_faults_per_mib_tell_huge_pages_from_small_ones(churned):
    rec, analysis = churned
    pages = analysis.pages.set_index("pid")
    huge, small = pages.loc[rec.tids["huge"]], pages.loc[rec.tids["small"]]
    for row in (huge, small):
        assert row["mapped_bytes"] >= rec.tids["mapped_bytes"]
    assert small["faults_per_mib"] > 200, small  # ~256 with 4 KiB pages
    assert huge["faults_per_mib"] < 2, huge  # ~0.5 with 2 MiB pages
    assert small["faults_per_mib"] > 100 * huge["faults_per_mib"]
    assert bool(huge["huge_pages"]) and not bool(small["huge_pages"])


def test_the_report_and_the_findings_say_so(churned):
    rec, analysis = churned
    report = Report.of(analysis)
    memory = {p["pid"]: p for p in report.doc["memory"]["processes"]}
    assert memory[rec.tids["small"]]["huge_pages"] is False and memory[rec.tids["huge"]]["huge_pages"] is True
    text = render_text(report)
    assert f"Transparent huge pages: {rec.trace.meta['thp']['enabled']}" in text
    assert f"process {rec.tids['huge']}: " in text and "huge pages (2 MiB) used" in text
    assert f"process {rec.tids['small']}: " in text and "4 KiB pages: huge pages would take" in text
    assert "faults per MiB newly mapped" in render_html(report)
    # What a page-fault or churn finding of the small-page process says.
    small = page_evidence(analysis.pages, [rec.tids["small"]], analysis.thp)
    assert small["case"] == "small_pages" and small["faults_saved_by_huge_pages"] > 0.9 * small["mapped_bytes"] / 4096
    who = [{"tid": rec.tids["small"], "comm": "python3", "role": "trainer"}]
    for category in ("page_faults", "allocator_churn"):
        said = finding_summary(category, 0.5, 1.0, who, small)
        assert "in 4 KiB pages" in said and "huge pages would take" in said, said
        assert "MADV_HUGEPAGE" in recommendation(category, small)
    huge = page_evidence(analysis.pages, [rec.tids["huge"]], analysis.thp)
    assert huge["huge_pages"] is True and "case" not in huge
    both = page_evidence(analysis.pages, [rec.tids["huge"], rec.tids["small"]], analysis.thp)
    assert both["small_page_pids"] == [rec.tids["small"]] and both["faults_per_mib"] > 200  # not diluted


def test_without_enough_mapped_bytes_there_is_no_ratio():
    mm = pd.DataFrame({"ts_ns": [10, 11, 12], "pid": [1, 1, 2], "tid": [1, 1, 2], "syscall": ["mmap", "munmap", "mmap"],
                       "length": [4 << 20, 64 << 20, 64 << 20], "ret": [0x7f0000000000, 0, -12]})
    faults = pd.DataFrame({"ts_ns": [10, 12], "pid": [1, 2], "tid": [1, 2], "faults": [1024, 5]})
    assert len(process_pages(mm, faults, Span(0, 100))) == 0  # 4 MiB mapped; the failed mmap maps nothing
    vmstat = pd.DataFrame({"ts_ns": [10, 20], "key": ["thp_fault_alloc", "pgfault"], "delta": [32, 9]})
    state = thp_state({"thp": {"enabled": "madvise", "defrag": "madvise"}}, vmstat, Span(0, 100))
    assert state == {"enabled": "madvise", "defrag": "madvise", "thp_fault_alloc": 32, "thp_fault_fallback": 0}
    assert page_evidence(process_pages(mm, faults, Span(0, 100)), [1], state) == {"thp": state}
