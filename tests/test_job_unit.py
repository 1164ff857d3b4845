"""The job analyzers on made-up frames: which processes are ranks, collectives matched
across ranks by their exits, the last arrival, and the waiting ranks' time charged to
what the late rank did beyond the others in that step."""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import CATEGORY_DTYPE
from trainbpf.analyzers.findings.ranking import FINDING_COLUMNS
from trainbpf.analyzers.job.charge import charge
from trainbpf.analyzers.job.collectives import (
    MIN_LEAD_NS,
    match_collectives,
    rank_summary,
    waits_for,
)
from trainbpf.analyzers.job.join import RankTables, join_ranks
from trainbpf.analyzers.job.ranks import job_ranks, process_fields, rank_of_threads
from trainbpf.analyzers.vocab import ROLE_DTYPE, STATE_DTYPE

MS = 1_000_000


def _threads(rows):
    tid, pid, comm = zip(*rows)
    return pd.DataFrame({"tid": np.array(tid, np.int64), "pid": np.array(pid, np.int64), "comm": list(comm),
                         "role": pd.Categorical(["other"] * len(rows), dtype=ROLE_DTYPE), "role_source": "",
                         "first_ns": np.zeros(len(rows), np.int64), "last_ns": np.full(len(rows), 10**10, np.int64)})


def _thread_rows(parents):
    """`thread` rows (view names) seeding each process with its parent."""
    pids = list(parents)
    return pd.DataFrame({"ts_ns": np.zeros(len(pids), np.int64), "tid": pids, "pid": pids, "comm": "x",
                         "peer_tid": [parents[p] for p in pids], "event": "seed"})


def _env(rows):
    pid, variable, value = zip(*rows)
    return pd.DataFrame({"ts_ns": np.ones(len(rows), np.int64), "pid": list(pid), "variable": list(variable),
                         "value": list(value)})


def test_ranks_come_from_environments_and_workers_belong_to_their_rank():
    # launcher 10 (srun's SLURM_PROCID=0) -> ranks 11, 12 (RANK) -> 13: rank 12's DataLoader worker.
    threads = _threads([(10, 10, "pt_elastic"), (11, 11, "python"), (12, 12, "python"), (13, 13, "pt_data_worker"),
                        (14, 11, "pt_gloo_runloop")])
    rows = _thread_rows({10: 1, 11: 10, 12: 10, 13: 12})
    env = _env([(10, "SLURM_PROCID", "0"), (11, "RANK", "1"), (11, "WORLD_SIZE", "2"), (11, "LOCAL_RANK", "1"),
                (11, "SLURM_PROCID", "0"), (12, "RANK", "0"), (12, "WORLD_SIZE", "2"), (12, "SLURM_PROCID", "0"),
                (13, "RANK", "0"), (13, "WORLD_SIZE", "2"), (11, "TORCHELASTIC_RUN_ID", "abc")])
    ranks = job_ranks(threads, rows, env)
    assert ranks["pid"].tolist() == [12, 11] and ranks["rank"].tolist() == [0, 1]
    assert ranks["world_size"].tolist() == [2, 2] and ranks["local_rank"].tolist() == [-1, 1]
    assert ranks["source"].tolist() == ["environment"] * 2
    assert ranks.loc[ranks["pid"] == 11, "job"].item() == "TORCHELASTIC_RUN_ID=abc"
    assert rank_of_threads(threads, rows, ranks).tolist() == [-1, 1, 0, 0, 1]


def test_a_shell_that_passed_its_rank_on_is_a_launcher():
    # srun starts `bash -c "python train.py"` per task: both have SLURM_PROCID; python trains.
    threads = _threads([(20, 20, "bash"), (21, 21, "python"), (30, 30, "bash"), (31, 31, "python")])
    rows = _thread_rows({20: 1, 21: 20, 30: 1, 31: 30})
    env = _env([(20, "SLURM_PROCID", "0"), (21, "SLURM_PROCID", "0"), (30, "SLURM_PROCID", "1"),
                (31, "SLURM_PROCID", "1"), (21, "SLURM_NTASKS", "2"), (31, "SLURM_NTASKS", "2")])
    ranks = job_ranks(threads, rows, env)
    assert ranks["pid"].tolist() == [21, 31] and ranks["world_size"].tolist() == [2, 2]


def test_without_environments_ranks_are_the_processes_with_collective_threads():
    threads = _threads([(10, 10, "torchrun"), (11, 11, "python"), (15, 11, "gloo_tcp_loop"), (12, 12, "python"),
                        (16, 12, "pt_gloo_runloop"), (13, 13, "python")])
    ranks = job_ranks(threads, _thread_rows({10: 1, 11: 10, 12: 10, 13: 10}), _env([(13, "HOME", "/")])[:0])
    assert ranks["pid"].tolist() == [11, 12] and ranks["source"].tolist() == ["behaviour"] * 2
    assert ranks["trainer_tid"].tolist() == [11, 12]


def test_one_rank_is_no_job():
    threads = _threads([(11, 11, "python"), (15, 11, "gloo_tcp_loop")])
    assert job_ranks(threads, _thread_rows({11: 1}), _env([(11, "RANK", "0")])).empty


def test_values_that_are_no_numbers_are_ignored():
    fields = process_fields(_env([(1, "RANK", "x1"), (1, "SLURM_PROCID", "3"), (2, "RANK", "9" * 12)]))
    assert fields.set_index("pid")["rank"].to_dict() == {1: 3, 2: -1}


def _calls(rows):
    rank, arrive, leave = zip(*rows)
    return pd.DataFrame({"rank": list(rank), "arrive_ns": np.array(arrive, np.int64) * MS,
                         "exit_ns": np.array(leave, np.int64) * MS})


def test_collectives_match_by_exit_and_a_rank_that_never_blocked_arrived_last():
    # Three steps of 70 ms: rank 1 late by 30 ms in steps 0 and 1 (it never blocked in
    # step 0), rank 0 late in step 2; exits within a millisecond of each other.
    calls = _calls([(0, 40, 70), (2, 41, 70), (0, 110, 140), (1, 139, 141), (2, 110, 140),
                    (1, 181, 210), (2, 182, 210)])
    arrivals, last = match_collectives(calls, [0, 1, 2])
    assert last["last_rank"].tolist() == [1, 1, 0]
    assert (last["lead_ns"] >= 25 * MS).all()
    assert not arrivals[(arrivals["collective"] == 0) & (arrivals["rank"] == 1)]["waited"].item()
    summary = rank_summary(arrivals, last, [0, 1, 2]).set_index("rank")
    assert summary.loc[1, "last"] == 2 and summary.loc[0, "last"] == 1
    assert summary.loc[1, "others_waited_ns"] == (30 + 29 + 29 + 29) * MS


def test_a_lead_below_the_noise_floor_blames_nobody():
    calls = _calls([(0, 40, 50), (1, 40, 50)])
    calls.loc[1, "arrive_ns"] += MIN_LEAD_NS // 2
    arrivals, last = match_collectives(calls, [0, 1])
    waits = pd.DataFrame({"rank": [0, 1], "interval": [0, 0], "exit_ns": calls["exit_ns"]})
    assert waits_for(waits, last)["straggler"].tolist() == [-1, -1]


def _pieces(rows):
    start, end, category, interval = zip(*rows)
    start, end = np.array(start, np.int64) * MS, np.array(end, np.int64) * MS
    return pd.DataFrame({"start_ns": start, "end_ns": end, "ns": (end - start).astype(np.float64),
                         "state": pd.Categorical(["running"] * len(rows), dtype=STATE_DTYPE),
                         "category": pd.Categorical(list(category), dtype=CATEGORY_DTYPE),
                         "root_tid": 1, "interval": np.array(interval, np.int64), "end": -1})


def test_waits_are_charged_to_what_the_late_rank_did_beyond_the_others():
    # Step from 0 to the collective: rank 0 on its GPU (unwoken sleep, "other") 0-40 ms,
    # then waits 40-70; rank 1 decodes 0-30 (input_pipeline) and is on its GPU 30-70.
    rank0 = _pieces([(0, 40, "other", 0), (40, 72, "collective", 1)])
    rank1 = _pieces([(0, 30, "input_pipeline", 0), (30, 70, "other", 1), (70, 72, "collective", 2)])
    calls = _calls([(0, 40, 72), (1, 70, 72)])
    arrivals, last = match_collectives(calls, [0, 1])
    waits = waits_for(pd.DataFrame({"rank": [0, 1], "interval": [1, 2], "exit_ns": [72 * MS, 72 * MS]}), last)
    assert last["last_rank"].tolist() == [1] and waits["straggler"].tolist() == [1, -1]
    job = charge({0: (100, rank0[rank0["interval"] == 1], rank0), 1: (101, rank1[rank1["interval"] == 2], rank1)},
                 waits, arrivals, last)
    charged = job[(job["rank"] == 0) & (job["culprit_rank"] == 1)]
    assert set(charged["category"].astype(str)) == {"input_pipeline"}
    assert abs(charged["ns"].sum() - 30 * MS) < 1e3
    rest = job[(job["rank"] == 0) & (job["culprit_rank"] == 0)]
    assert set(rest["category"].astype(str)) == {"collective"} and abs(rest["ns"].sum() - 2 * MS) < 1e3


def test_ranks_that_never_waited_in_a_collective_have_no_straggler():
    calls = _calls([(0, 1, 2)]).iloc[:0]
    arrivals, last = match_collectives(calls, [0, 1])
    assert arrivals.empty and last.empty
    waits = waits_for(pd.DataFrame({"rank": np.zeros(0, np.int64), "interval": np.zeros(0, np.int64),
                                    "exit_ns": np.zeros(0, np.int64)}), last)
    own = _pieces([(0, 10, "input_pipeline", 0)])
    job = charge({0: (100, own, own), 1: (101, own.iloc[:0], own)}, waits, arrivals, last)
    assert job["ns"].sum() == own["ns"].sum()
    summary = rank_summary(arrivals, last, [0, 1])
    assert summary["last_share"].tolist() == [0.0, 0.0]


def _found(rank: int, tid: int, rows: list[tuple[str, float]], table: str) -> pd.DataFrame:
    """A rank's own findings (FINDING_COLUMNS), each saying which table it came from."""
    return pd.DataFrame([{"category": c, "share": 0.5, "seconds": sec, "severity": "info",
                          "threads": [{"tid": tid, "comm": "python", "role": "trainer", "pid": tid}],
                          "chain": [{"tid": tid, "role": "trainer", "state": "x"}],
                          "evidence": {"starved_s": sec, "table": table, "of_rank": rank}, "launch_gap_s": np.nan}
                         for c, sec in rows], columns=list(FINDING_COLUMNS))


def test_the_join_shows_each_category_by_its_culprit_ranks_own_findings():
    # Rank 1 decodes 0-30 ms, then is on its GPU to 71 and waits 1 ms; rank 0 is on its
    # GPU 0-40 and waits 40-74: 31 ms of it for rank 1, 3 ms the collective's own time.
    rank0 = _pieces([(0, 40, "other", 0), (40, 74, "collective", 1)])
    rank1 = _pieces([(0, 30, "input_pipeline", 0), (30, 71, "other", 1), (71, 72, "collective", 2)])
    tables = []
    for rank, tid, pieces, wait, arrive, leave in ((0, 100, rank0, 1, 40, 74), (1, 101, rank1, 2, 71, 72)):
        calls = _calls([(rank, arrive, leave)])
        waits = pd.DataFrame({"rank": [rank], "interval": [wait], "exit_ns": [leave * MS]})
        own = _found(rank, tid, [("collective", (leave - arrive) / 1e3)] + [("input_pipeline", 0.03)] * rank, "own")
        spent = _found(rank, tid, [("input_pipeline", 0.03)] if rank else [("other", 0.04)], "spent")
        tables.append(RankTables(rank=rank, local_rank=rank, world_size=2, pid=tid, trainer_tid=tid, job="", source="environment",
                                 node="n", calls=calls, waits=waits, starved=pieces[pieces["interval"] == wait],
                                 timeline=pieces, own=own, spent=spent))
    job = join_ranks(tables, window_ns=100 * MS)
    found = job.findings.set_index("category")
    # Rank 0 waited 31 ms for rank 1: 30 for its decoding (1 for its longer GPU step),
    # shown as what rank 1 did, behind rank 0's wait.
    decoding = found.loc["input_pipeline"]
    assert decoding["evidence"]["table"] == "spent" and decoding["evidence"]["of_rank"] == 1
    assert abs(decoding["seconds"] - 0.030) < 1e-6 and decoding["evidence"]["held_ranks"] == [0]
    assert [(c["tid"], c["rank"]) for c in decoding["chain"]] == [(100, 0), (101, 1)]
    # The collective's own time lay mostly on rank 0: its own finding, with its own part
    # of the job's time (3 ms), not its whole 34 ms wait.
    own_time = found.loc["collective"]
    assert own_time["evidence"]["table"] == "own" and own_time["evidence"]["of_rank"] == 0
    assert abs(own_time["evidence"]["starved_s"] - 0.003) < 1e-6 and abs(own_time["seconds"] - 0.004) < 1e-6
    assert job.straggler is not None and job.straggler["rank"] == 1
    assert job.straggler["category"] == "input_pipeline"


def test_a_rank_is_measured_against_its_own_gpu():
    from trainbpf.analyzers.timeline.starvation import rank_gpu

    windows = pd.DataFrame({"gpu": ["GPU-b", "GPU-a", "GPU-c"], "start_ns": [0, 0, 0], "end_ns": [9, 9, 9],
                            "idle_ns": [1.0, 2.0, 3.0], "weight": [1 / 3] * 3})
    names = {0: "GPU-b", 1: "GPU-a", 2: "GPU-c"}  # by index, not by name

    def chosen(local_rank, visible=""):
        picked = rank_gpu(windows, local_rank=local_rank, visible=visible, names=names)
        return picked["gpu"].tolist() if len(picked) == 1 and picked["weight"].tolist() == [1.0] else None

    assert chosen(1) == ["GPU-a"] and chosen(0) == ["GPU-b"]
    assert chosen(1, "2,0") == ["GPU-b"]  # cuda:1 is the second visible device, index 0
    assert chosen(0, "2") == ["GPU-c"] and chosen(3, "GPU-c") == ["GPU-c"]  # one visible device: that one
    assert chosen(-1) is None and chosen(5) is None and chosen(2, "0,1") is None  # nothing says which: all
