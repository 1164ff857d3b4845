"""Multi-process jobs on the real kernel: torchrun jobs of scripts/workloads/ddp_job.py
(gloo on the CPU, one simulated GPU per rank), recorded through the launcher's pid.  One
rank is made late in every step, by decoding its own batches or by page-fault churn; the
others wait for it inside all_reduce.  The analysis must name that rank the straggler,
its cause, and charge the waiting ranks' time to it.  A healthy job has no straggler."""

from __future__ import annotations

import pytest
from job_harness import JOB_RECORD_SECONDS, JobRun, record_job
from kernel_env import require_module, require_root

RANK_KEYS = {"rank", "local_rank", "world_size", "pid", "starved_s", "collective_wait_s", "last_arrival_share",
             "top_category"}
STRAGGLER_KEYS = {"rank", "pid", "last_arrival_share", "others_waited_s", "category"}
# The late rank's extra work is 0.75 of a 40 ms step, every step: each other rank waits
# about 30 ms of every ~75 ms step for it.  A tenth of the recording, per waiting rank,
# leaves room for a slow machine.
MIN_HELD_SHARE = 0.1


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, JobRun]:
    require_root("records a torchrun job")
    require_module("torch", "a torchrun job")
    runs = {}
    for name, ranks, slow in (("input", 3, "input"), ("faults", 2, "faults"), ("healthy", 2, "none")):
        runs[name] = record_job(tmp_path_factory.mktemp(f"job-{name}"), ranks=ranks, slow=slow, slow_rank=1)
    runs["rank0"] = record_job(tmp_path_factory.mktemp("job-rank0"), ranks=2, slow="input", slow_rank=1,
                               seconds=3, target_rank=0)
    return runs


def _finding(report: dict, category: str) -> dict:
    return next(f for f in report["findings"] if f["category"] == category)


def test_a_late_input_pipeline_is_the_straggler_and_explains_every_rank(jobs):
    run = jobs["input"]
    report = run.report
    assert [r["pid"] for r in report["ranks"]] == sorted(run.rank_pids), report["ranks"]
    assert all(RANK_KEYS <= set(r) for r in report["ranks"])
    assert [(r["rank"], r["local_rank"], r["world_size"], r["source"]) for r in report["ranks"]] == \
        [(0, 0, 3, "environment"), (1, 1, 3, "environment"), (2, 2, 3, "environment")]
    straggler = report["straggler"]
    assert straggler is not None and set(straggler) == STRAGGLER_KEYS, report["ranks"]
    assert straggler["rank"] == 1 and straggler["category"] == "input_pipeline", straggler
    assert straggler["last_arrival_share"] >= 0.8, straggler
    assert straggler["others_waited_s"] >= MIN_HELD_SHARE * JOB_RECORD_SECONDS * 2, straggler
    top = report["findings"][0]
    assert top["category"] == "input_pipeline", [(f["category"], f["share"]) for f in report["findings"]]
    assert {"kind": "rank", "rank": 1}.items() <= next(c for c in top["culprits"] if c["kind"] == "rank").items()
    # The waiting ranks' starved time is charged to rank 1's decoding.
    explained = {r["rank"]: r["seconds"] for r in top["evidence"]["starved_ranks"]}
    assert {0, 2} <= set(explained) and min(explained[0], explained[2]) >= MIN_HELD_SHARE * JOB_RECORD_SECONDS
    assert top["evidence"]["held_ranks"] == [0, 2]
    by_rank = {r["rank"]: r for r in report["ranks"]}
    assert by_rank[0]["top_category"] == by_rank[2]["top_category"] == "input_pipeline", report["ranks"]
    assert by_rank[1]["last_arrival_share"] > max(by_rank[0]["last_arrival_share"], by_rank[2]["last_arrival_share"])
    # The launcher is no trainer; gloo's threads carry collectives, not data.
    roles = {t["tid"]: t["role"] for t in report["threads"]}
    assert run.launcher_pid not in roles or roles[run.launcher_pid] != "trainer"
    assert {t["role"] for t in report["threads"] if "gloo" in t["comm"]} == {"collective"}
    assert "Straggler: rank 1" in run.text and "top cause" in run.text, run.text[:3000]


def test_page_fault_churn_on_one_rank_is_named_on_that_rank(jobs):
    report = jobs["faults"].report
    straggler = report["straggler"]
    assert straggler is not None and straggler["rank"] == 1, report["ranks"]
    assert straggler["category"] in ("page_faults", "allocator_churn"), straggler
    top = report["findings"][0]
    assert top["category"] in ("page_faults", "allocator_churn"), [(f["category"], f["share"]) for f in report["findings"]]
    assert top["evidence"]["held_ranks"] == [0]


def test_a_healthy_job_has_no_straggler_and_no_critical_finding(jobs):
    report = jobs["healthy"].report
    assert len(report["ranks"]) == 2
    assert report["straggler"] is None, report["ranks"]
    assert not [f for f in report["findings"] if f["severity"] == "critical"], report["findings"]
    assert "Straggler: none" in jobs["healthy"].text


def test_one_rank_recorded_alone_waits_in_collectives_for_ranks_not_traced(jobs):
    run = jobs["rank0"]
    report = run.report
    assert report["ranks"] is None and report["straggler"] is None
    top = report["findings"][0]
    assert top["category"] == "collective", [(f["category"], f["share"]) for f in report["findings"]]
    assert top["threads"][0]["tid"] == sorted(run.rank_pids)[0]
    backend = {t["comm"] for t in top["evidence"]["backend_threads"]}
    assert backend and all("gloo" in comm for comm in backend), backend
    assert "Rank 0 of 2: the other ranks are not traced" in run.text, run.text[:1500]
    assert "is rank 0 of 2; the other rank is not traced" in run.record_log, run.record_log
