"""A job of several ranks, analysed as one (docs/findings.md, "Multi-process jobs").

Each rank's trainer is analysed as a trainer of its own (analyzers/trainer.py), against
its own GPU.  Its waits inside collectives (analyzers/job/collectives.py) are then not its
own stalls: from its arrival to the arrival of the rank it waited for, they are charged
to what that rank's trainer was doing meanwhile (its `timeline`: stalls followed down
their chains, host work by its Python frames); the rest of the wait is the collective's
own communication (category `collective`).  A finding of the job sums a category over
every rank, so the slow rank's cause explains the starved time of all of them.

Here a trace's ranks are analysed and cut down to the small tables a join needs
(join.RankTables); analyzers/job/join.py joins them, for one trace's ranks as for several
traces' (analyzers/job_traces.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.findings.ranking import build_findings
from trainbpf.analyzers.intervals import as_int64
from trainbpf.analyzers.job.collectives import collective_waits
from trainbpf.analyzers.job.join import JobResult, RankTables, join_ranks
from trainbpf.analyzers.job.ranks import process_fields, rank_of_threads
from trainbpf.analyzers.threads.containers import process_containers
from trainbpf.analyzers.timeline.starvation import gpu_names_by_index, rank_gpu
from trainbpf.analyzers.trainer import Shared, TrainerPart, roles, trainer_part


def collective_pids(rows: pd.DataFrame) -> np.ndarray:
    """Processes that made NCCL calls (`collective` rows)."""
    return np.unique(as_int64(rows["pid"])) if len(rows) else np.zeros(0, np.int64)


def backend_tids(threads: pd.DataFrame, trainer: int | None) -> np.ndarray:
    """The collective backend's threads of the trainer's own process."""
    if trainer is None:
        return np.zeros(0, np.int64)
    pid = threads.loc[threads["tid"] == trainer, "pid"]
    mine = (threads["role"] == "collective").to_numpy() & np.isin(threads["pid"].to_numpy(), pid.to_numpy())
    return threads.loc[mine, "tid"].to_numpy(np.int64)


def as_collective(starved: pd.DataFrame, waits: np.ndarray, trainer: int | None) -> pd.DataFrame:
    """Starved pieces with those inside the trainer's waits at positions `waits` (its
    waits inside collectives) as `collective`, the trainer their root."""
    hit = np.isin(starved["interval"].to_numpy(np.int64), waits)
    if not hit.any():
        return starved
    out = starved.copy()
    out.loc[hit, "category"] = "collective"
    out.loc[hit, "root_tid"] = -1 if trainer is None else int(trainer)
    out.loc[hit, "end"] = -1
    return out


def in_collectives(part: TrainerPart, backend: np.ndarray) -> pd.DataFrame:
    """The trainer's starved pieces with its waits inside collectives (those `backend`
    threads ended) as `collective`: a rank traced without its peers, whose lateness the
    trace cannot show."""
    return as_collective(part.starved, collective_waits(part.states, backend), part.trainer)


def analyze_job(sh: Shared, ranks: pd.DataFrame
                ) -> tuple[pd.DataFrame, dict[int, TrainerPart], JobResult, dict[str, Any]]:
    """(threads with roles, each rank's analysis, the job, the job's view for the report:
    the first rank's GPU basis, utilisation and idle fraction) for a trace of
    several ranks (ranks.RANK_COLUMNS): its ranks' tables joined as any job's are."""
    threads, thread_rank, parts, tables, view = rank_tables(sh, ranks)
    job = join_ranks(tables, window_ns=sh.win.ns)
    job.thread_ranks = pd.Series(thread_rank, index=threads["tid"].to_numpy())
    return threads, parts, job, view


def rank_tables(sh: Shared, ranks: pd.DataFrame
                ) -> tuple[pd.DataFrame, np.ndarray, dict[int, TrainerPart], list[RankTables], dict[str, Any]]:
    """Each rank of a trace analysed as a trainer of its own, against its own GPU, and
    cut down to the tables a join needs (join.RankTables): (threads with roles, each
    thread's rank, the ranks' analyses, their tables, the view of the first rank's GPU:
    basis, util, gpu_idle)."""
    trainers = {int(t): sh.trainer_states(int(t)) for t in ranks["trainer_tid"]}
    threads = roles(sh, trainers)
    thread_rank = rank_of_threads(threads, sh.trace.view("thread"), ranks)
    parts: dict[int, TrainerPart] = {}
    bases: dict[int, str] = {}
    view: dict[str, Any] = {}
    visible = process_fields(sh.trace.view("process_env")).set_index("pid")["visible_devices"].to_dict()
    names = gpu_names_by_index(sh.trace.view("gpu"))
    for r in ranks.itertuples(index=False):
        pids = frozenset(int(p) for p in threads.loc[thread_rank == r.rank, "pid"].unique())
        basis, util, windows, gpu_idle = sh.gpu(pids)
        windows = rank_gpu(windows, local_rank=int(r.local_rank), visible=visible.get(int(r.pid), ""), names=names)
        states, followed = trainers[int(r.trainer_tid)]
        parts[int(r.rank)] = trainer_part(sh, threads, int(r.trainer_tid), states, followed, basis=basis,
                                          windows=windows, with_timeline=True)
        bases[int(r.rank)] = basis
        view = view or {"basis": basis, "util": util, "gpu_idle": gpu_idle}
    calls, waits = _calls(sh, threads, parts)
    pid_of = dict(zip(threads["tid"].tolist(), threads["pid"].tolist()))
    node = str(sh.meta.get("host") or "")
    boxes = process_containers(sh.trace.view("container")).set_index("pid")["id"].to_dict()
    tables = [_tables(r, parts[int(r.rank)], calls, waits, node, pid_of, bases[int(r.rank)], boxes.get(int(r.pid), ""))
              for r in ranks.itertuples(index=False)]
    return threads, thread_rank, parts, tables, view


def _tables(r: Any, part: TrainerPart, calls: pd.DataFrame, waits: pd.DataFrame, node: str,
            pid_of: dict[int, int], basis: str, container: str) -> RankTables:
    """One rank's RankTables (`r`: its ranks.RANK_COLUMNS row, `basis`: its GPU's,
    `container`: the id of its process's, "" none)."""
    rank = int(r.rank)
    mine = waits[waits["rank"] == rank].reset_index(drop=True)
    inside = mine["interval"].to_numpy(np.int64)
    timeline = part.timeline
    spent = timeline[~np.isin(timeline["interval"].to_numpy(np.int64), inside)].reset_index(drop=True)

    def found(pieces: pd.DataFrame) -> pd.DataFrame:
        out = build_findings(pieces, part.chains, part.chain_ends, part.ctx, trainer_tid=part.trainer, gaps=part.gaps)
        # tids of several traces may be equal: each thread named carries its process.
        out["threads"] = [[{**t, "pid": pid_of.get(int(t["tid"]))} for t in threads] for threads in out["threads"]]
        return out

    w = part.gpu_windows
    return RankTables(
        rank=rank, local_rank=int(r.local_rank), world_size=int(r.world_size), pid=int(r.pid),
        trainer_tid=int(r.trainer_tid), job=str(r.job), source=str(r.source), node=node,
        calls=calls[calls["rank"] == rank].reset_index(drop=True), waits=mine, starved=part.starved,
        timeline=timeline, own=found(as_collective(part.starved, inside, part.trainer)), spent=found(spent),
        gpu_samples=len(w) if basis == "gpu_idle" else 0, host_bound_ns=float((w["host_bound_ns"] * w["weight"]).sum()),
        container=container)


def _calls(sh: Shared, threads: pd.DataFrame, parts: dict[int, TrainerPart]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every rank's collective calls (rank, arrive_ns, exit_ns) and its trainer's waits
    inside them (rank, interval: the wait's position among its states, exit_ns: its
    call's).  With NCCL calls traced a call is the trainer's call, else each wait a
    backend thread ended is one."""
    nccl = sh.trace.view("collective")
    calls, waits = [], []
    for rank, part in parts.items():
        st = part.states
        mine = nccl[as_int64(nccl["tid"]) == part.trainer] if len(nccl) else nccl
        if len(mine):
            mine = mine.sort_values("ts_ns", kind="stable")
            arrive = as_int64(mine["ts_ns"])
            leave = arrive + as_int64(mine["dur_ns"], 0)
            start = st["start_ns"].to_numpy(np.int64)
            at = np.searchsorted(arrive, start, side="right") - 1
            inside = (at >= 0) & (start < leave[np.maximum(at, 0)]) & (st["state"] != "running").to_numpy()
            rows, exit_ns = np.flatnonzero(inside), leave[at[inside]]
            # A call's exit is its last wake-up inside it where it blocked: its return
            # comes later by however long it then queued for a CPU.
            blocked = inside & (st["state"] != "runnable").to_numpy()
            woke = pd.Series(st["end_ns"].to_numpy(np.int64)[blocked]).groupby(at[blocked]).max()
            leave = leave.copy()
            leave[woke.index.to_numpy()] = np.minimum(leave[woke.index.to_numpy()], woke.to_numpy())
            exit_ns = leave[at[inside]]
        else:
            rows = collective_waits(st, backend_tids(threads, part.trainer))
            arrive = st["start_ns"].to_numpy(np.int64)[rows]
            leave = exit_ns = st["end_ns"].to_numpy(np.int64)[rows]
        calls.append(pd.DataFrame({"rank": np.full(len(arrive), rank, np.int64), "arrive_ns": arrive, "exit_ns": leave}))
        waits.append(pd.DataFrame({"rank": np.full(len(rows), rank, np.int64), "interval": rows.astype(np.int64),
                                   "exit_ns": np.asarray(exit_ns, np.int64)}))
    return pd.concat(calls, ignore_index=True), pd.concat(waits, ignore_index=True)
