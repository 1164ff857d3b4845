"""The nccl probe on real uprobes: rank processes on the stand-in NCCL (scripts/fake-nccl,
built into a pip-wheel-like tree) that load it after the recording started, started by
a launcher that never loads it."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_env import require_root
from recording import record_cli, record_workload
from standins import build_standin

from trainbpf.analyzers.pipeline import analyze

pytestmark = pytest.mark.kernel

WORKLOAD = Path(__file__).with_name("nccl_workloads.py")
RANKS, CALLS, SLOW_RANK, SLOW_MS = 3, 40, 1, 10
PROBED = sorted(["ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
                 "ncclSend", "ncclRecv", "ncclGroupEnd"])


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    require_root()
    return build_standin("fake-nccl", tmp_path_factory.mktemp("nccl") / "wheel")


@pytest.fixture(scope="module")
def allreduce(library, tmp_path_factory):
    """Every probe, as `record` runs by default."""
    out = tmp_path_factory.mktemp("allreduce") / "trace.parquet"
    return record_workload(out, "", command=[sys.executable, str(WORKLOAD), "allreduce", str(library), str(RANKS),
                                             str(CALLS), str(SLOW_RANK), str(SLOW_MS)])


def _rows(rec, pid: int) -> list[tuple]:
    """A process's collective rows in their order: (name, seq, elements, comm, ret, tid)."""
    rows = rec.trace.view("collective")
    mine = rows[rows.pid == pid].sort_values("seq")
    return list(zip(mine["name"], mine["seq"].astype(int), mine["elements"].astype(int),
                    mine["comm"].astype(int), mine["ret"].astype(int), mine["tid"].astype(int)))


def test_every_allreduce_of_every_rank_is_a_row_in_order(allreduce):
    ranks = allreduce.tids["ranks"]
    assert len(ranks) == RANKS
    for rank in ranks:
        assert rank["comm"] != 0
        expected = [(name, seq, elements, comm, ret, rank["tid"])
                    for seq, (name, elements, comm, ret) in enumerate(rank["calls"])]
        assert len(expected) == CALLS and {r[0] for r in expected} == {"ncclAllReduce"}
        assert _rows(allreduce, rank["pid"]) == expected, f"rank {rank['rank']}"
    assert set(allreduce.trace.view("collective").pid) == {r["pid"] for r in ranks}
    assert allreduce.trace.meta["lost"]["nccl"] == 0


def test_the_rank_that_arrives_last_waits_least(allreduce):
    """Rank 1 sleeps 10 ms before each call: ranks 0 and 2 wait that long in theirs, rank 1
    only for the barrier to let it through."""
    rows = allreduce.trace.view("collective")
    median = {r["rank"]: statistics.median(rows[rows.pid == r["pid"]].dur_ns) for r in allreduce.tids["ranks"]}
    print({rank: round(ns / 1e6, 3) for rank, ns in median.items()})
    assert median[SLOW_RANK] < 2e6, median
    for rank in set(median) - {SLOW_RANK}:
        assert median[rank] > 6e6 and median[rank] > 10 * median[SLOW_RANK], median


def test_library_found_after_start_and_probed_once(allreduce):
    """One library file, probed by its 8 calls once each (the pnccl* aliases share their
    addresses), for every rank that mapped it; the launcher never did."""
    libs = allreduce.trace.meta["nccl"]["libraries"]
    assert len(libs) == 1, libs
    lib = libs[0]
    assert lib["path"].endswith("site-packages/nvidia/nccl/lib/libnccl.so.2")
    assert sorted(lib["symbols"]) == PROBED and not lib["failed"]
    assert sorted(lib["pids"]) == sorted(r["pid"] for r in allreduce.tids["ranks"])
    assert allreduce.pid not in lib["pids"]
    assert allreduce.result.nccl_libraries == 1
    assert "nccl" in allreduce.trace.meta["probes"]


def test_groups_and_point_to_point_counted_exactly(library, tmp_path):
    """ncclSend and ncclRecv between ncclGroupStart and ncclGroupEnd (which is a row, in
    the same sequence; ncclGroupStart is not), then one call of each other collective,
    ncclReduce's communicator being its 7th argument (on the stack), and a call that
    fails: each row's arguments and return as the caller saw them."""
    require_root()
    rounds = 15
    rec = record_workload(tmp_path / "trace.parquet", "", probes=["nccl"],
                          command=[sys.executable, str(WORKLOAD), "p2p", str(library), "2", str(rounds)])
    for rank in rec.tids["ranks"]:
        expected = [(name, seq, elements, comm, ret, rank["tid"])
                    for seq, (name, elements, comm, ret) in enumerate(rank["calls"])]
        names = [r[0] for r in expected]
        assert names.count("ncclSend") == names.count("ncclRecv") == names.count("ncclGroupEnd") == rounds
        assert expected[-1][0] == "ncclBroadcast" and expected[-1][3:5] == (0, 4)  # no comm: ncclInvalidArgument
        assert _rows(rec, rank["pid"]) == expected, f"rank {rank['rank']}"
    assert rec.trace.meta["lost"]["nccl"] == 0


def test_record_says_which_library_it_probed(library, tmp_path):
    """One line for the NCCL library attached, or one saying none is mapped."""
    with_nccl = subprocess.Popen([sys.executable, "-c", f"import ctypes, time; ctypes.CDLL({str(library)!r}); "
                                  "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    without = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with_nccl.stdout.readline()  # loaded
        lines = [ln for ln in record_cli(tmp_path, "nccl", with_nccl.pid).splitlines() if ln.startswith("nccl:")]
        assert lines == [f"nccl: probing 8 symbols in {library} (process {with_nccl.pid})"], lines
        said = record_cli(tmp_path, "nccl", without.pid)
        assert "nccl: no NCCL library (libnccl) was mapped by the traced processes" in said, said
    finally:
        for p in (with_nccl, without):
            p.kill()
            p.wait()


def test_the_analysis_matches_every_call_and_names_the_late_rank(allreduce):
    """The job's analysis from the NCCL calls: every rank took part in each of the CALLS
    collectives, and rank 1, which slept before each, arrived last in nearly all."""
    analysis = analyze(allreduce.trace)
    job = analysis.job
    assert job is not None
    ranks = job.ranks.set_index("rank")
    assert ranks["pid"].to_dict() == {r["rank"]: r["pid"] for r in allreduce.tids["ranks"]}
    assert (ranks["collectives"] == CALLS).all(), ranks["collectives"]
    assert job.straggler is not None and job.straggler["rank"] == SLOW_RANK, job.ranks
    assert ranks.loc[SLOW_RANK, "last_share"] >= 0.9, ranks["last_share"]
    # each waiting rank waited about SLOW_MS for it in every call
    held = job.straggler["others_waited_s"] / ((RANKS - 1) * CALLS)
    assert 0.5 * SLOW_MS / 1e3 <= held <= 2 * SLOW_MS / 1e3, held
