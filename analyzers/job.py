"""A job of several ranks, analysed as one (docs/findings.md, "Multi-process jobs").

Each rank's trainer is analysed as a trainer of its own (analyzers/trainer.py), against
its own GPU.  Its waits inside collectives (analyzers/collectives.py) are then not its
own stalls: from its arrival to the arrival of the rank it waited for, they are charged
to what that rank's trainer was doing meanwhile (its `timeline`: stalls followed down
their chains, host work by its Python frames); the rest of the wait is the collective's
own communication (category `collective`).  A finding of the job sums a category over
every rank, so the slow rank's cause explains the starved time of all of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.categories import CATEGORY_DTYPE
from trainbpf.analyzers.collectives import (
    collective_waits, match_collectives, rank_summary, waits_for,
)
from trainbpf.analyzers.findings import ATTRIBUTED_COLUMNS, FINDING_COLUMNS, MIN_FINDING_NS, build_findings, severity
from trainbpf.analyzers.intervals import NS_PER_S, as_int64
from trainbpf.analyzers.charge import charge
from trainbpf.analyzers.ranks import rank_of_threads
from trainbpf.analyzers.trainer import Shared, TrainerPart, roles, trainer_part

# A rank is the job's straggler when it arrived last in at least this share of the
# collectives (and more than STRAGGLER_OVER_FAIR times its fair share, 1/ranks) ...
STRAGGLER_MIN_SHARE = 0.5
STRAGGLER_OVER_FAIR = 1.5
# ... and the others waited for it at least this share of the window, per waiting rank.
STRAGGLER_MIN_HELD = 0.02
# A rank holding less than this share of a finding's time is not named as its culprit.
CULPRIT_MIN_SHARE = 0.01


@dataclass
class JobResult:
    """Every rank's analysis and the job's: `ranks` is ranks.RANK_COLUMNS plus each rank's
    numbers (RANK_NUMBERS); `straggler` the rank the others waited for (keys rank, pid,
    last_arrival_share, others_waited_s, category) or None."""

    ranks: pd.DataFrame
    parts: dict[int, TrainerPart]
    arrivals: pd.DataFrame  # collectives.ARRIVAL_COLUMNS
    last: pd.DataFrame  # collectives.LAST_COLUMNS
    straggler: dict[str, Any] | None
    thread_ranks: pd.Series  # tid -> rank (-1: none, a launcher)


RANK_NUMBERS = ("starved_ns", "collective_wait_ns", "collectives", "last_share", "others_waited_ns",
                "step_p50_ns", "top_category")


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


def in_collectives(part: TrainerPart, backend: np.ndarray) -> pd.DataFrame:
    """The trainer's starved pieces with its waits inside collectives (those `backend`
    threads ended) as `collective`, the trainer their root: a rank traced without its
    peers, whose lateness the trace cannot show."""
    starved = part.starved
    rows = collective_waits(part.states, backend)
    hit = np.isin(starved["interval"].to_numpy(np.int64), rows)
    if not hit.any():
        return starved
    out = starved.copy()
    out.loc[hit, "category"] = "collective"
    out.loc[hit, "root_tid"] = -1 if part.trainer is None else int(part.trainer)
    out.loc[hit, "end"] = -1
    return out


def analyze_job(sh: Shared, ranks: pd.DataFrame, threshold: float) -> tuple[pd.DataFrame, JobResult, dict[str, Any]]:
    """(threads with roles, the job, the job's view for the report: the first rank's GPU
    basis, utilisation, idle stretches and fraction, with the job's starved pieces and
    findings) for a trace of several ranks (ranks.RANK_COLUMNS)."""
    trainers = {int(t): sh.trainer_states(int(t)) for t in ranks["trainer_tid"]}
    threads = roles(sh, trainers)
    thread_rank = rank_of_threads(threads, sh.trace.view("thread"), ranks)
    parts: dict[int, TrainerPart] = {}
    view: dict[str, Any] = {}
    for r in ranks.itertuples(index=False):
        pids = frozenset(int(p) for p in threads.loc[thread_rank == r.rank, "pid"].unique())
        basis, util, windows, idle, gpu_idle = sh.gpu(pids, threshold)
        states, followed = trainers[int(r.trainer_tid)]
        parts[int(r.rank)] = trainer_part(sh, threads, int(r.trainer_tid), states, followed, basis=basis,
                                          windows=_rank_gpu(windows, int(r.local_rank)), with_timeline=True)
        view = view or {"basis": basis, "util": util, "idle": idle, "gpu_idle": gpu_idle}
    calls, waits = _calls(sh, threads, parts)
    arrivals, last = match_collectives(calls, list(parts))
    starved, held_up = charge({rank: (p.trainer, p.starved, p.timeline) for rank, p in parts.items()},
                              waits_for(waits, last), arrivals, last)
    summary = _rank_numbers(ranks, parts, arrivals, last, starved)
    job = JobResult(ranks=summary, parts=parts, arrivals=arrivals, last=last,
                    straggler=_straggler(summary, starved, sh.win.ns),
                    thread_ranks=pd.Series(thread_rank, index=threads["tid"].to_numpy()))
    view["starved"] = starved
    view["findings"] = _job_findings(job, starved, held_up, window_s=sh.win.seconds)
    return threads, job, view


def _rank_gpu(windows: pd.DataFrame, local_rank: int) -> pd.DataFrame:
    """A rank's GPU among several: the local_rank-th (by name), weighing 1."""
    gpus = sorted(pd.unique(windows["gpu"]).tolist())
    if len(gpus) < 2 or not 0 <= local_rank < len(gpus):
        return windows
    return windows[windows["gpu"] == gpus[local_rank]].assign(weight=1.0)


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


def _rank_numbers(ranks: pd.DataFrame, parts: dict[int, TrainerPart], arrivals: pd.DataFrame, last: pd.DataFrame,
                  job: pd.DataFrame) -> pd.DataFrame:
    """RANK_COLUMNS + RANK_NUMBERS."""
    summary = rank_summary(arrivals, last, list(parts)).set_index("rank")
    out = ranks.copy()
    by_rank = job.groupby("rank")["ns"].sum()
    top = job.groupby(["rank", "category"], observed=True)["ns"].sum()
    out["starved_ns"] = by_rank.reindex(out["rank"]).fillna(0.0).to_numpy()
    out["collective_wait_ns"] = summary["waited_ns"].reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    out["collectives"] = summary["collectives"].reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    out["last_share"] = summary["last_share"].reindex(out["rank"]).fillna(0.0).to_numpy()
    out["others_waited_ns"] = summary["others_waited_ns"].reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    exits = arrivals.groupby("rank")["exit_ns"].apply(lambda e: float(np.median(np.diff(np.sort(e.to_numpy())))) if len(e) > 1 else np.nan)
    out["step_p50_ns"] = exits.reindex(out["rank"]).to_numpy(np.float64)
    out["top_category"] = [str(top.loc[r].idxmax()) if r in top.index.get_level_values(0) else "" for r in out["rank"]]
    return out


def _straggler(ranks: pd.DataFrame, job: pd.DataFrame, window_ns: int) -> dict[str, Any] | None:
    """The rank the others waited for, or None: it arrived last in most collectives,
    well above its fair share, and held each other rank at least STRAGGLER_MIN_HELD of
    the window."""
    n = len(ranks)
    if n < 2 or not len(ranks) or float(ranks["last_share"].max()) <= 0:
        return None
    best = ranks.loc[ranks["last_share"].idxmax()]
    held = float(best["others_waited_ns"]) / (n - 1)
    if best["last_share"] < max(STRAGGLER_MIN_SHARE, STRAGGLER_OVER_FAIR / n) or held < STRAGGLER_MIN_HELD * window_ns:
        return None
    theirs = job[(job["culprit_rank"] == best["rank"]) & (job["rank"] != best["rank"])]
    per = theirs.groupby("category", observed=True)["ns"].sum()
    return {"rank": int(best["rank"]), "pid": int(best["pid"]), "last_arrival_share": float(best["last_share"]),
            "others_waited_s": float(best["others_waited_ns"]) / NS_PER_S,
            "category": str(per.idxmax()) if len(per) and per.max() > 0 else None}


def _job_findings(job: JobResult, starved: pd.DataFrame, held_up: pd.DataFrame, *, window_s: float) -> pd.DataFrame:
    """One finding per category over every rank (findings.FINDING_COLUMNS): its seconds
    the job's pieces of that category, whichever rank's starved time they were.  The
    rank where most of them lay gives the threads, chain and evidence, from what it did
    itself (its own starved pieces, and `held_up`: its pieces of the steps others waited
    for it, as spent); `evidence` adds `rank` (that rank), `starved_ranks` (whose starved
    time the finding explains), `held_ranks` (those that waited in collectives for that
    rank's work of this category) and `culprit_ranks` (where its time lay, with pids)."""
    total = float(starved["ns"].sum())
    pid_of = dict(zip(job.ranks["rank"].tolist(), job.ranks["pid"].tolist()))
    trainer_of = dict(zip(job.ranks["rank"].tolist(), job.ranks["trainer_tid"].tolist()))
    per_rank = []
    for rank, part in job.parts.items():
        own = starved[(starved["culprit_rank"] == rank) & (starved["rank"] == rank)]
        mine = pd.concat([own[list(ATTRIBUTED_COLUMNS)], held_up.loc[held_up["rank"] == rank, list(ATTRIBUTED_COLUMNS)]],
                         ignore_index=True).sort_values("start_ns", kind="stable").reset_index(drop=True)
        found = build_findings(mine, part.chains, part.chain_ends, part.ctx, trainer_tid=part.trainer, gaps=part.gaps)
        per_rank.append(found.assign(rank=rank))
    found = pd.concat(per_rank, ignore_index=True)
    rows = []
    for category, pieces in starved.groupby("category", observed=True, sort=False):
        ns = float(pieces["ns"].sum())
        by_culprit = pieces.groupby("culprit_rank")["ns"].sum().sort_values(ascending=False)
        group = found[found["category"] == category]
        if ns < MIN_FINDING_NS or not len(group):
            continue
        at = group["rank"].to_numpy() == int(by_culprit.index[0])
        best = group[at].iloc[0] if at.any() else group.loc[group["seconds"].idxmax()]
        seconds = ns / NS_PER_S
        share = min(1.0, ns / total) if total > 0 else 0.0
        by_victim = pieces.groupby("rank")["ns"].sum().sort_values(ascending=False)
        chain = [{**link, "rank": int(best["rank"])} for link in best["chain"]]
        others = pieces[(pieces["culprit_rank"] == best["rank"]) & (pieces["rank"] != best["rank"])]
        if float(others["ns"].sum()) > 0.5 * float(pieces.loc[pieces["culprit_rank"] == best["rank"], "ns"].sum()):
            waiter = int(others.groupby("rank")["ns"].sum().idxmax())
            chain = [{"tid": int(trainer_of[waiter]), "role": "trainer", "state": "collective", "rank": waiter}] + chain
        evidence = {**best["evidence"], "rank": int(best["rank"]),
                    "starved_ranks": [{"rank": int(r), "seconds": float(v) / NS_PER_S} for r, v in by_victim.items()],
                    "held_ranks": sorted(int(r) for r in others["rank"].unique()),
                    "culprit_ranks": [{"rank": int(r), "pid": int(pid_of[int(r)]), "seconds": float(v) / NS_PER_S}
                                      for r, v in by_culprit.items() if v >= CULPRIT_MIN_SHARE * ns]}
        gap = group["launch_gap_s"].to_numpy(np.float64)
        rows.append({"category": str(category), "share": share, "seconds": seconds,
                     "severity": severity(share, seconds, window_s * max(1, len(job.parts)), str(category)),
                     "threads": best["threads"], "chain": chain, "evidence": evidence,
                     "launch_gap_s": float(np.nansum(gap)) if np.isfinite(gap).any() else float("nan")})
    out = pd.DataFrame(rows, columns=list(FINDING_COLUMNS))
    out = out.astype({"share": np.float64, "seconds": np.float64, "launch_gap_s": np.float64})
    return out.sort_values(["share", "seconds"], ascending=False, kind="stable").reset_index(drop=True)
