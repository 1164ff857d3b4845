"""Several traces of one job analysed as one (`trainbpf analyze NODE0 NODE1 ...`), on
synthetic node traces (scripts/bench/gen_job.py): a job whose rank 3 waits 20-30 ms for
its DataLoader worker in most steps, its ranks spread over the traces, each trace in its
node's own clock with its own error in its wall-clock offset.  The straggler, its cause,
each trace's residual clock offset, a node 50 ms off, and every input that is not one
job's traces, through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_modules import bench_module

from trainbpf.analyzers.job.clocks import BIN_NS, align_traces, residual

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))
MS = 1_000_000
SLOW_RANK = 3
SECONDS = 6.0
TRACES_KEYS = {"path", "host", "pid", "ranks", "residual_offset_ms", "aligned_by"}
RANK_KEYS = {"rank", "local_rank", "world_size", "pid", "trainer_tid", "node", "source", "starved_s",
             "collective_wait_s", "collectives", "step_p50_ms", "last_arrival_share", "top_category", "container"}


gen_job = bench_module("gen_job")


def analyze(*args, fmt: str = "json") -> subprocess.CompletedProcess:
    return subprocess.run([TRAINBPF, "analyze", *map(str, args), "--format", fmt], capture_output=True, text=True,
                          timeout=300)


def _report(*paths) -> tuple[dict, str]:
    run = analyze(*paths)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout), run.stderr


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, list[Path]]:
    """The job of 6 ranks as three traces of 2 (clock errors 0, +1.5, -2 ms), as one
    trace of all 6, and as two traces of 3 with the second node's clock 50 ms off."""
    folder = tmp_path_factory.mktemp("job")
    return {
        "three": gen_job.write_job(folder / "three", traces=3, ranks_per_trace=2, seconds=SECONDS, slow_rank=SLOW_RANK,
                                   clock_errors_ms=[0.0, 1.5, -2.0]),
        "one": gen_job.write_job(folder / "one", traces=1, ranks_per_trace=6, seconds=SECONDS, slow_rank=SLOW_RANK),
        "shifted": gen_job.write_job(folder / "shifted", traces=2, ranks_per_trace=3, seconds=SECONDS,
                                     slow_rank=SLOW_RANK, clock_errors_ms=[0.0, 50.0]),
    }


def test_traces_of_one_job_name_the_straggler_its_cause_and_each_clock(job):
    doc, stderr = _report(*job["three"])
    assert doc["schema"] == "trainbpf.report/3" and doc["trace"]["path"] == [str(p) for p in job["three"]]
    assert doc["threads"] == [] and doc["cuda"] is None
    assert [set(t) for t in doc["traces"]] == [TRACES_KEYS] * 3
    assert [t["ranks"] for t in doc["traces"]] == [[0, 1], [2, 3], [4, 5]]
    assert [t["aligned_by"] for t in doc["traces"]] == ["reference", "collectives", "collectives"]
    # A clock whose wall-clock offset was 1.5 ms late is moved 1.5 ms back, and so on.
    residuals = [t["residual_offset_ms"] for t in doc["traces"]]
    assert residuals[0] == 0 and abs(residuals[1] + 1.5) < 0.3 and abs(residuals[2] - 2.0) < 0.3, residuals
    assert "warning" not in stderr  # no residual above 5 ms
    assert [r["rank"] for r in doc["ranks"]] == list(range(6)) and all(set(r) == RANK_KEYS for r in doc["ranks"])
    assert [r["node"] for r in doc["ranks"]] == ["node0", "node0", "node1", "node1", "node2", "node2"]
    straggler = doc["straggler"]
    assert straggler["rank"] == SLOW_RANK and straggler["category"] == "input_pipeline", doc["ranks"]
    assert straggler["last_arrival_share"] >= 0.8 and straggler["others_waited_s"] >= 5 * 0.1 * SECONDS
    top = doc["findings"][0]
    assert top["category"] == "input_pipeline" and top["evidence"]["rank"] == SLOW_RANK
    assert top["evidence"]["held_ranks"] == [0, 1, 2, 4, 5]
    assert {"kind": "rank", "rank": SLOW_RANK}.items() <= next(c for c in top["culprits"] if c["kind"] == "rank").items()
    # The collectives' own time, shown on a waiting rank: its own part of it, not its whole waits.
    collective = next(f for f in doc["findings"] if f["category"] == "collective")
    assert collective["evidence"]["starved_s"] <= collective["seconds"], collective["evidence"]
    # Its dataloader thread is named with its own process, though every trace has one of that tid.
    thread = next(c for c in top["culprits"] if c["kind"] == "thread")
    assert thread["pid"] == thread["tid"] and thread["name"] == "pt_data_worker"
    text = analyze(*job["three"], fmt="text")
    assert text.returncode == 0, text.stderr
    assert f"Straggler: rank {SLOW_RANK}" in text.stdout and "node2: " in text.stdout
    assert "aligned by collectives" in text.stdout and "3 traces of one job" in text.stdout


def test_one_trace_of_the_whole_job_says_what_the_traces_together_say(job):
    """The single trace's job and the join of several go the same way after each rank's analysis."""
    whole, _ = _report(*job["one"])
    split, _ = _report(*job["three"])
    assert whole["traces"] is None and whole["straggler"]["rank"] == split["straggler"]["rank"] == SLOW_RANK
    assert whole["straggler"]["category"] == split["straggler"]["category"]
    for a, b in zip(whole["ranks"], split["ranks"]):
        assert a["rank"] == b["rank"] and abs(a["collectives"] - b["collectives"]) <= 2, (a, b)
        assert abs(a["collective_wait_s"] - b["collective_wait_s"]) <= 0.05 * max(a["collective_wait_s"], 0.2), (a, b)
    assert abs(whole["findings"][0]["seconds"] - split["findings"][0]["seconds"]) <= 0.05 * whole["findings"][0]["seconds"]


def test_a_node_clock_50_ms_off_is_found_by_its_collectives(job):
    doc, stderr = _report(*job["shifted"])
    residual_ms = doc["traces"][1]["residual_offset_ms"]
    assert abs(residual_ms + 50.0) < 0.5 and doc["traces"][1]["aligned_by"] == "collectives", doc["traces"]
    assert doc["straggler"]["rank"] == SLOW_RANK and doc["straggler"]["category"] == "input_pipeline", doc["ranks"]
    assert f"{job['shifted'][1]} (node1): its clock was -50.0 ms off" in stderr, stderr
    text = analyze(*job["shifted"], fmt="text").stdout
    assert "WARNING: " in text and "-50.0 ms off" in text


def _exits(seed: int, steps: int = 200) -> np.ndarray:
    """Exits of collectives about 100 ms apart, each step's length random."""
    rng = np.random.default_rng(seed)
    return 10**12 + np.cumsum(rng.uniform(60, 140, steps) * MS).astype(np.int64)


def test_residual_is_the_peak_of_the_exit_differences_not_a_step_away():
    exits = _exits(0)
    # Node 1 reads 50 ms late on the wall clock and each exit is 0.2 ms apart at most.
    late = exits + 50 * MS + np.random.default_rng(1).integers(0, 200_000, len(exits))
    shift, matched = residual(np.sort(late), exits)
    assert abs(shift + 50 * MS) < BIN_NS and matched >= 0.95 * len(exits)
    aligned = align_traces([exits, late - 7_000 * MS], [0, 7_000 * MS])
    assert aligned["aligned_by"].tolist() == ["reference", "collectives"]
    assert abs(aligned["offset_ns"][1] - (7_000 * MS - 50 * MS)) < BIN_NS


def test_exits_that_never_line_up_keep_the_wall_clock():
    aligned = align_traces([_exits(0), _exits(2)], [0, 0])
    assert aligned["aligned_by"].tolist() == ["reference", "wall clock"]
    assert aligned["residual_ns"].tolist() == [0, 0] and aligned["offset_ns"].tolist() == [0, 0]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    """Short node traces of a job of 4 ranks, and traces that are not of it."""
    folder = tmp_path_factory.mktemp("bad")
    plan = gen_job.plan_job(4, 2.0)

    def node(name: str, ranks: list[int], **kwargs) -> Path:
        return gen_job.write_trace(folder / f"{name}.parquet", plan, ranks, **{"host": name, "boot_s": 1000, **kwargs})

    import synth

    return {
        "a": node("a", [0, 1]),
        "b": node("b", [2, 3]),
        "other_job": node("other_job", [2, 3], run_id="another-job"),
        "a_again": gen_job.write_trace(folder / "a_again.parquet", plan, [0, 1], host="a", boot_s=1000, start_s=0.2),
        "same_ranks": node("same_ranks", [0, 1], boot_s=3000),
        "behaviour": node("behaviour", [2, 3], env=False),
        "no_job": synth.healthy(2.0).write(folder / "no_job.parquet"),
    }


@pytest.mark.parametrize("names, message", [
    (("a", "other_job"), "hold ranks of different jobs (TORCHELASTIC_RUN_ID=synthetic-job and "
                         "TORCHELASTIC_RUN_ID=another-job)"),
    (("a", "a"), "are the same recording (host a, started at the same instant)"),
    (("a", "a_again"), "recorded the same processes of host a: two recordings of one node"),
    (("a", "no_job"), "no_job.parquet: no rank of a job in this trace"),
    (("a", "behaviour"), "behaviour.parquet: its ranks are known by behaviour only"),
    (("a", "same_ranks"), "rank 0 is in both"),
])
def test_traces_that_are_not_one_job_are_refused_in_one_line(bad, names, message):
    run = analyze(*(bad[n] for n in names))
    assert run.returncode == 16 and run.stdout == "", (run.returncode, run.stdout[:300])
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("trainbpf: error: ") and message in run.stderr, run.stderr


def test_the_two_nodes_of_that_job_are_accepted(bad):
    doc, _ = _report(bad["a"], bad["b"])
    assert [t["ranks"] for t in doc["traces"]] == [[0, 1], [2, 3]] and doc["straggler"]["rank"] == 1


@pytest.mark.parametrize("extra, message", [
    (("--window", "0:1"), "--window applies to one trace"),
    (("--trainer-tid", "1010"), "--trainer-tid applies to one trace"),
    (("--format", "html"), "--format html takes one trace"),
])
def test_options_of_one_trace_are_refused_with_several(bad, extra, message):
    run = subprocess.run([TRAINBPF, "analyze", str(bad["a"]), str(bad["b"]), *extra], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


def test_ranks_in_containers_of_their_own(tmp_path):
    """Each rank in a container of its own (container rows, as a node's recorder reads
    them from the ranks' cgroups): each rank's `container` in the JSON, and a container
    column in the text report's rank table; none where the ranks share no container rows."""
    paths = gen_job.write_job(tmp_path, traces=2, ranks_per_trace=2, seconds=SECONDS, slow_rank=1, containers=True)
    doc, _ = _report(*paths)
    assert [r["container"] for r in doc["ranks"]] == [gen_job.container_id(r) for r in range(4)]
    text = analyze(*paths, fmt="text").stdout
    head = next(line for line in text.splitlines() if line.strip().startswith("rank "))
    assert head.split()[-1] == "container", text
    assert all(gen_job.container_id(r)[:12] in text for r in range(4)), text
    plain, _ = _report(*gen_job.write_job(tmp_path / "plain", traces=2, ranks_per_trace=2, seconds=SECONDS))
    assert [r["container"] for r in plain["ranks"]] == [None] * 4
