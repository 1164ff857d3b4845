"""Multi-process jobs on the real kernel: torchrun jobs of scripts/workloads/ddp_job.py
(gloo on the CPU, one simulated GPU per rank), recorded through the launcher's pid.  One
rank is made late in every step, by decoding its own batches or by page-fault churn; the
others wait for it inside all_reduce.  The analysis must name that rank the straggler,
its cause, and charge the waiting ranks' time to it.  A healthy job has no straggler.
The same recordings give the job's HTML lanes, Perfetto tracks, health series and fleet
row."""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest
from job_harness import JOB_RECORD_SECONDS, JobRun, record_job
from kernel_env import require_module, require_root

from trainbpf.analyzers.pipeline import analyze
from trainbpf.fleet import fleet_rows, render
from trainbpf.health.config import HealthConfig
from trainbpf.health.outputs import health_document, metric_samples, render_textfile
from trainbpf.health.run import assess
from trainbpf.health.targets import Target
from trainbpf.reports.document import Report
from trainbpf.reports.html import render_html
from trainbpf.reports.perfetto import trace_events
from trainbpf.trace.reader import read_trace

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


# -- the job's outputs: HTML, Perfetto, health and fleet, from the same recordings -------

@pytest.fixture(scope="module")
def rendered(jobs) -> dict[str, Report]:
    """The input-pipeline job and the healthy one, analysed once for the HTML and Perfetto."""
    return {name: Report.of(analyze(read_trace(jobs[name].trace))) for name in ("input", "healthy")}


def test_html_draws_a_lane_per_rank_and_the_rank_table(jobs, rendered):
    for name, straggler in (("input", "rank 1 (pid {pid}) arrived last in"), ("healthy", "none (")):
        report = jobs[name].report
        html = render_html(rendered[name])
        lanes = re.findall(r'<g class="rank-lane" data-rank="(\d+)" data-pid="(\d+)" data-tid="\d+">\s*'
                           r'<text x="8" y="[\d.]+">rank (\d+) \(pid (\d+)\)</text>', html)
        assert [(int(a), int(b)) for a, b, c, d in lanes if (a, b) == (c, d)] == \
            [(r["rank"], r["pid"]) for r in report["ranks"]], lanes
        assert 'aria-label="GPU-starvation timeline"' in html and ">trainer state<" not in html
        # each rank's strip of its own starved time, by cause
        strips = [html[html.index(f'data-rank="{r["rank"]}" data-pid'):].split("</g>", 1)[0] for r in report["ranks"]]
        assert all('class="starved"' in s for s in strips)
        rows = re.findall(r'<tr data-rank="(\d+)"><td class="n">\d+</td><td class="n">(\d+)</td>', html)
        assert [(int(a), int(b)) for a, b in rows] == [(r["rank"], r["pid"]) for r in report["ranks"]]
        pid = report["straggler"]["pid"] if report["straggler"] else None
        assert f"<b>Straggler:</b> {straggler.format(pid=pid)}" in html


def test_perfetto_gives_each_rank_a_process_with_its_collectives(jobs, rendered):
    analysis = rendered["input"].analysis
    events = json.loads("[" + ",".join(trace_events(analysis)) + "]")
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    ranks = jobs["input"].report["ranks"]
    assert {r["pid"]: names[r["pid"]] for r in ranks} == {r["pid"]: f"rank {r['rank']} (pid {r['pid']})" for r in ranks}
    collectives = [e for e in events if e.get("cat") == "collective"]
    per_pid = Counter(e["pid"] for e in collectives)
    arrivals = analysis.job.arrivals.groupby("rank").size()
    assert per_pid == {r["pid"]: int(arrivals[r["rank"]]) for r in ranks} and min(per_pid.values()) > 10, per_pid
    # rank 1 arrived last in most of them, by ms; the others spent them waiting for it
    mine = [e for e in collectives if e["pid"] == ranks[1]["pid"]]
    late = [e for e in mine if e["args"]["last_rank"] == 1]
    # by about the injected 30 ms (a step's first collective after the barrier may be close)
    assert len(late) >= 0.8 * len(mine) and sorted(e["args"]["lead_ms"] for e in late)[len(late) // 2] >= 10.0
    waiting = [e["dur"] for e in collectives if e["pid"] != ranks[1]["pid"] and e["args"]["last_rank"] == 1]
    assert sorted(waiting)[len(waiting) // 2] > 3 * sorted(e["dur"] for e in late)[len(late) // 2]
    # each rank's trainer states on its own process, its starved time beside them
    states = Counter(e["pid"] for e in events if e.get("cat") == "state" and e["tid"] == e["pid"])
    starved = Counter(e["pid"] for e in events if e.get("cat") == "starved")
    assert all(states[r["pid"]] > 10 and starved[r["pid"]] > 0 for r in ranks), (states, starved)


def test_health_writes_the_ranks_and_the_straggler_of_a_launchers_job(jobs, tmp_path):
    docs = []
    for name, straggler in (("input", 1), ("healthy", -1)):
        run = jobs[name]
        tree = {run.launcher_pid, *run.rank_pids}
        result = assess(trace_path=run.trace, targets=[Target(run.launcher_pid, "torchrun", "torchrun ...", "pattern")],
                        trees={run.launcher_pid: (tree, tree)}, config=HealthConfig(), started=time.time(), host=name)
        [target] = result.targets
        # the launcher is graded from the job's analysis: every rank's starved time, per rank
        assert target.error is None and target.starved_s == run.report["starved_s"]
        assert target.starved_ratio == pytest.approx(run.report["starved_s"] / len(run.rank_pids)
                                                     / run.report["trace"]["duration_s"])
        samples = {(n, tuple(sorted(labels.items()))): v for n, labels, v in metric_samples(result)}
        assert samples[("trainbpf_straggler_rank", ())] == straggler
        for r in run.report["ranks"]:
            labels = (("pid", str(r["pid"])), ("rank", str(r["rank"])))
            assert samples[("trainbpf_rank_collective_wait_seconds", labels)] == r["collective_wait_s"]
            assert samples[("trainbpf_rank_starved_seconds", labels)] == r["starved_s"]
            assert samples[("trainbpf_rank_last_arrival_ratio", labels)] == r["last_arrival_share"]
        assert f"trainbpf_straggler_rank {float(straggler)}" in render_textfile(result)
        docs.append((tmp_path / f"{name}.json", health_document(result)))
    rows = {r.host: r for r in fleet_rows(docs)}
    assert (rows["input"].straggler_rank, rows["healthy"].straggler_rank) == (1, -1)
    assert "stragglers (the rank its job's other ranks waited for): rank 1 on input" in render(list(rows.values()), "text")
