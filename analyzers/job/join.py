"""A job's ranks joined (docs/findings.md, "Multi-process jobs"): from every rank's small
tables (RankTables: its collective calls and waits, its starved and timeline pieces, its
own findings), whether they came from one trace or from several, the collectives matched
across ranks, the waits charged to the rank waited for, each rank's numbers, the
straggler and the job's findings.  Nothing here reads a trace: a trace's ranks are
analysed where it is read (analyzers/job/rank_analysis.py), and only these tables travel."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.findings.ranking import FINDING_COLUMNS, MIN_FINDING_NS, severity
from trainbpf.analyzers.intervals import NS_PER_S
from trainbpf.analyzers.job.charge import charge
from trainbpf.analyzers.job.collectives import match_collectives, rank_summary, waits_for

# A rank is the job's straggler when it arrived last in at least this share of the
# collectives (and more than STRAGGLER_OVER_FAIR times its fair share, 1/ranks) ...
STRAGGLER_MIN_SHARE = 0.5
STRAGGLER_OVER_FAIR = 1.5
# ... and the others waited for it at least this share of the window, per waiting rank.
STRAGGLER_MIN_HELD = 0.02
# A rank holding less than this share of a finding's time is not named as its culprit.
CULPRIT_MIN_SHARE = 0.01
# The numbers of each rank (JobResult.ranks, after ranks.RANK_COLUMNS and `node`).
RANK_NUMBERS = ("starved_ns", "collective_wait_ns", "collectives", "last_share", "others_waited_ns",
                "step_p50_ns", "top_category")


@dataclass
class RankTables:
    """One rank's part of a job, small enough to pass between processes: who it is
    (ranks.RANK_COLUMNS, and `node`: its trace's host), its calls into collectives
    (collectives.CALL_COLUMNS) and its trainer's waits inside them (WAIT_COLUMNS), its
    starved pieces and timeline (findings.ATTRIBUTED_COLUMNS), and its own findings
    (findings.FINDING_COLUMNS): `own` over its starved pieces with its collective waits
    as `collective`, `spent` over its timeline outside those waits (what it did while
    others may have waited for it).  Each finding's threads carry their `pid`.  Times are
    its trace's clock until `shifted`."""

    rank: int
    local_rank: int
    world_size: int
    pid: int
    trainer_tid: int
    job: str
    source: str
    node: str
    calls: pd.DataFrame
    waits: pd.DataFrame
    starved: pd.DataFrame
    timeline: pd.DataFrame
    own: pd.DataFrame
    spent: pd.DataFrame
    gpu_samples: int = 0  # its GPU's samples in its window (0: starved time without GPU samples)
    host_bound_ns: float = 0.0  # its starved time its trainer's own CPU work explains
    container: str = ""  # the id of the container its process ran in ("" none)

    def shifted(self, ns: int) -> RankTables:
        """The same tables with every time moved by `ns` (onto another trace's clock)."""
        def move(frame: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
            out = frame.copy(deep=False)
            for c in columns:
                out[c] = frame[c].to_numpy(np.int64) + np.int64(ns)
            return out

        return replace(self, calls=move(self.calls, ("arrive_ns", "exit_ns")), waits=move(self.waits, ("exit_ns",)),
                       starved=move(self.starved, ("start_ns", "end_ns")),
                       timeline=move(self.timeline, ("start_ns", "end_ns")))


@dataclass
class JobResult:
    """The job: `ranks` is ranks.RANK_COLUMNS, `node` and each rank's RANK_NUMBERS;
    `straggler` the rank the others waited for (keys rank, pid, last_arrival_share,
    others_waited_s, category) or None; `starved` the job's pieces (ATTRIBUTED_COLUMNS +
    rank, culprit_rank) and `findings` its findings (FINDING_COLUMNS)."""

    ranks: pd.DataFrame
    arrivals: pd.DataFrame  # collectives.ARRIVAL_COLUMNS
    last: pd.DataFrame  # collectives.LAST_COLUMNS
    straggler: dict[str, Any] | None
    starved: pd.DataFrame
    findings: pd.DataFrame
    thread_ranks: pd.Series = field(default_factory=lambda: pd.Series([], dtype=np.int64))  # tid -> rank, one trace


def join_ranks(tables: list[RankTables], *, window_ns: int) -> JobResult:
    """The job of `tables` (every rank's, on one clock) over a window of `window_ns`."""
    ranks = pd.DataFrame([{"rank": t.rank, "local_rank": t.local_rank, "world_size": t.world_size, "pid": t.pid,
                           "trainer_tid": t.trainer_tid, "job": t.job, "source": t.source, "node": t.node,
                           "container": t.container}
                          for t in tables]).astype({"rank": np.int64, "local_rank": np.int64, "world_size": np.int64,
                                                    "pid": np.int64, "trainer_tid": np.int64})
    calls = pd.concat([t.calls for t in tables], ignore_index=True)
    waits = pd.concat([t.waits for t in tables], ignore_index=True)
    arrivals, last = match_collectives(calls, ranks["rank"].tolist())
    starved = charge({t.rank: (t.trainer_tid, t.starved, t.timeline) for t in tables}, waits_for(waits, last),
                     arrivals, last)
    summary = _rank_numbers(ranks, arrivals, last, starved)
    return JobResult(ranks=summary, arrivals=arrivals, last=last, straggler=_straggler(summary, starved, window_ns),
                     starved=starved, findings=_job_findings(tables, starved, window_s=window_ns / NS_PER_S))


def _rank_numbers(ranks: pd.DataFrame, arrivals: pd.DataFrame, last: pd.DataFrame, job: pd.DataFrame) -> pd.DataFrame:
    """RANK_COLUMNS + node + RANK_NUMBERS."""
    summary = rank_summary(arrivals, last, ranks["rank"].tolist()).set_index("rank")
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
    return out.sort_values(["rank", "pid"], kind="stable").reset_index(drop=True)


def _straggler(ranks: pd.DataFrame, job: pd.DataFrame, window_ns: int) -> dict[str, Any] | None:
    """The rank the others waited for, or None: it arrived last in most collectives,
    well above its fair share, and held each other rank at least STRAGGLER_MIN_HELD of
    the window."""
    n = len(ranks)
    if n < 2 or float(ranks["last_share"].max()) <= 0:
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


def _representative(tables: dict[int, RankTables], culprit: int, category: str, held: bool
                    ) -> tuple[int, pd.Series, bool] | None:
    """The finding row that shows a category, and whether it is of what that rank did
    while others waited (`spent`): the culprit rank's own, from its `spent` findings when
    most of its time in it was others' waiting (`held`), else from its `own`; failing
    both, the rank with the most of it in its `own`."""
    table = tables[culprit]
    for found, spent in ((table.spent, True), (table.own, False)) if held else ((table.own, False), (table.spent, True)):
        rows = found[found["category"] == category]
        if len(rows):
            return culprit, rows.iloc[0], spent
    rows = [(t.rank, r, False) for t in tables.values() for _, r in t.own[t.own["category"] == category].iterrows()]
    return max(rows, key=lambda row: row[1]["seconds"]) if rows else None


def _job_findings(tables: list[RankTables], starved: pd.DataFrame, *, window_s: float) -> pd.DataFrame:
    """One finding per category over every rank (findings.FINDING_COLUMNS): its seconds
    the job's pieces of that category, whichever rank's starved time they were.  The
    rank where most of them lay gives the threads, chain and evidence, from its own
    findings (_representative); `evidence` adds `rank` (that rank), `starved_ranks`
    (whose starved time the finding explains), `held_ranks` (those that waited in
    collectives for that rank's work of this category) and `culprit_ranks` (where its
    time lay, with pids)."""
    total = float(starved["ns"].sum())
    by_rank = {t.rank: t for t in tables}
    gap = pd.Series(np.concatenate([t.own["launch_gap_s"].to_numpy(np.float64) for t in tables]),
                    index=np.concatenate([t.own["category"].to_numpy(dtype=object) for t in tables]))
    gaps = gap.groupby(level=0).agg(lambda g: float(np.nansum(g)) if np.isfinite(g).any() else np.nan)
    rows = []
    for category, pieces in starved.groupby("category", observed=True, sort=False):
        ns = float(pieces["ns"].sum())
        by_culprit = pieces.groupby("culprit_rank")["ns"].sum().sort_values(ascending=False)
        culprit = int(by_culprit.index[0]) if len(by_culprit) else -1
        others = pieces[(pieces["culprit_rank"] == culprit) & (pieces["rank"] != culprit)]
        held = float(others["ns"].sum()) > 0.5 * float(pieces.loc[pieces["culprit_rank"] == culprit, "ns"].sum())
        best = _representative(by_rank, culprit, str(category), held) if ns >= MIN_FINDING_NS else None
        if best is None:
            continue
        rank, row, spent = best
        seconds = ns / NS_PER_S
        share = min(1.0, ns / total) if total > 0 else 0.0
        by_victim = pieces.groupby("rank")["ns"].sum().sort_values(ascending=False)
        chain = [{**link, "rank": rank} for link in row["chain"]]
        if held and rank == culprit:
            waiter = int(others.groupby("rank")["ns"].sum().idxmax())
            chain = [{"tid": by_rank[waiter].trainer_tid, "role": "trainer", "state": "collective", "rank": waiter}] + chain
        evidence = dict(row["evidence"])
        if not spent and "starved_s" in evidence:  # its own part of the job's time (not of its whole waits)
            mine = (pieces["rank"] == rank) & (pieces["culprit_rank"] == rank)
            evidence["starved_s"] = float(pieces.loc[mine, "ns"].sum()) / NS_PER_S
        evidence = {**evidence, "rank": rank,
                    "starved_ranks": [{"rank": int(r), "seconds": float(v) / NS_PER_S} for r, v in by_victim.items()],
                    "held_ranks": sorted(int(r) for r in others["rank"].unique()),
                    "culprit_ranks": [{"rank": int(r), "pid": by_rank[int(r)].pid, "seconds": float(v) / NS_PER_S}
                                      for r, v in by_culprit.items() if v >= CULPRIT_MIN_SHARE * ns]}
        rows.append({"category": str(category), "share": share, "seconds": seconds,
                     "severity": severity(share, seconds, window_s * max(1, len(tables)), str(category)),
                     "threads": row["threads"], "chain": chain, "evidence": evidence,
                     "launch_gap_s": float(gaps.get(str(category), np.nan))})
    out = pd.DataFrame(rows, columns=list(FINDING_COLUMNS))
    out = out.astype({"share": np.float64, "seconds": np.float64, "launch_gap_s": np.float64})
    return out.sort_values(["share", "seconds"], ascending=False, kind="stable").reset_index(drop=True)
