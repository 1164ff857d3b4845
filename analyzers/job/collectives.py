"""Collectives of a multi-process job: each rank's waits inside them, matched across
ranks, the rank that arrived last, and the waiting ranks' time charged to what that rank
was doing (docs/findings.md, "Multi-process jobs").

A rank's trainer is inside a collective while it waits for its collective backend: a
wait a gloo or NCCL thread of its own process ended.  Every rank leaves a collective
within the network's latency of the others, so the k-th collective of every rank is
found by clustering their exits in time: a rank that never blocked in it arrived last
(its peers were already there).  The rank whose arrival came last is that collective's
straggler; the others waited from their arrival to its arrival for it, and the rest of
their wait is the collective's own communication."""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.chains import is_followed
from trainbpf.analyzers.vocab import codes

# A call: one rank's time inside one collective (its trainer's call, or one wait of it
# that a backend thread ended).
CALL_COLUMNS = ("rank", "arrive_ns", "exit_ns")
# A wait of a rank's trainer inside a call (interval: its position among that trainer's
# states; exit_ns: its call's).
WAIT_COLUMNS = ("rank", "interval", "exit_ns")
# One row per (collective, rank that took part): when it arrived and left; `waited` is
# false for a rank that never blocked in it (it arrived when the others could go on).
ARRIVAL_COLUMNS = ("collective", "rank", "arrive_ns", "exit_ns", "waited")
# Per collective: the rank that arrived last and by how much before the one before it.
LAST_COLUMNS = ("collective", "last_rank", "last_arrive_ns", "lead_ns", "exit_ns")
# Exits of one collective lie closer than this part of a rank's usual spacing between
# collectives, and never farther apart than MAX_TOLERANCE_NS.
TOLERANCE_OF_SPACING = 0.25
MIN_TOLERANCE_NS = 200_000
MAX_TOLERANCE_NS = 20_000_000
# A last arrival less than this ahead of the one before it is noise: nobody waited for it.
MIN_LEAD_NS = 1_000_000


def collective_waits(trainer_states: pd.DataFrame, collective_tids: np.ndarray) -> np.ndarray:
    """Positions of the trainer's waits that a collective backend's thread ended."""
    state, fclass = codes(trainer_states["state"]), codes(trainer_states["futex_class"])
    waker = trainer_states["waker_tid"].to_numpy(np.int64)
    hit = is_followed(state, fclass, waker) & np.isin(waker, collective_tids)
    return np.flatnonzero(hit)


def match_collectives(calls: pd.DataFrame, ranks: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ARRIVAL_COLUMNS, LAST_COLUMNS) from every rank's calls (CALL_COLUMNS).  Exits
    closer than the tolerance are one collective; in it a rank's arrival is its first
    call's, and a rank with no call arrived at its end."""
    calls = calls.sort_values("exit_ns", kind="stable").reset_index(drop=True)
    calls = calls.assign(collective=exit_clusters(calls["exit_ns"].to_numpy(np.int64), exit_tolerance(calls)))
    first = calls.groupby(["collective", "rank"], sort=True).agg(arrive_ns=("arrive_ns", "min"),
                                                                exit_ns=("exit_ns", "max")).reset_index()
    ends = calls.groupby("collective")["exit_ns"].max()
    # Collectives at least two ranks were seen in, or one rank waited in for a while (its
    # peers arrived last, never blocking): a lone short wait is no collective the trace
    # can show the others took part in.
    seen = first.groupby("collective")["rank"].nunique()
    longest = (first["exit_ns"] - first["arrive_ns"]).groupby(first["collective"]).max().reindex(seen.index)
    keep = seen.index[(seen >= min(2, len(ranks))) | (longest >= MIN_LEAD_NS)].to_numpy()
    grid = pd.MultiIndex.from_product([keep, sorted(ranks)], names=["collective", "rank"]).to_frame(index=False)
    arrivals = grid.merge(first, on=["collective", "rank"], how="left")
    arrivals["waited"] = arrivals["arrive_ns"].notna()
    end = ends.reindex(arrivals["collective"]).to_numpy(np.int64)
    arrivals["arrive_ns"] = arrivals["arrive_ns"].fillna(pd.Series(end, index=arrivals.index)).astype(np.int64)
    arrivals["exit_ns"] = arrivals["exit_ns"].fillna(pd.Series(end, index=arrivals.index)).astype(np.int64)
    return arrivals[list(ARRIVAL_COLUMNS)], last_arrivals(arrivals)


def exit_clusters(exits: np.ndarray, tolerance: int) -> np.ndarray:
    """Per exit (sorted), its collective's number: exits closer than `tolerance` to the
    one before are one collective."""
    new = np.concatenate([[True], np.diff(exits) > tolerance]) if len(exits) else np.zeros(0, bool)
    return np.cumsum(new) - 1


def exit_tolerance(calls: pd.DataFrame) -> int:
    """How close exits of one collective lie (CALL_COLUMNS): TOLERANCE_OF_SPACING of the
    ranks' median spacing between calls, within its bounds."""
    spacing = calls.groupby("rank")["exit_ns"].apply(lambda e: np.median(np.diff(np.sort(e.to_numpy()))) if len(e) > 1 else np.nan)
    typical = float(np.nanmedian(spacing.to_numpy())) if spacing.notna().any() else float(MAX_TOLERANCE_NS)
    return int(np.clip(TOLERANCE_OF_SPACING * typical, MIN_TOLERANCE_NS, MAX_TOLERANCE_NS))


def last_arrivals(arrivals: pd.DataFrame) -> pd.DataFrame:
    """LAST_COLUMNS: per collective, its last rank to arrive and its lead over the one
    before; ties go to the rank that never waited, then the lowest rank."""
    if not len(arrivals):
        return pd.DataFrame({c: np.zeros(0, np.int64) for c in LAST_COLUMNS})
    order = arrivals.sort_values(["collective", "arrive_ns", "waited", "rank"], ascending=[True, True, False, False],
                                 kind="stable")
    grouped = order.groupby("collective", sort=True)
    last = grouped.tail(1).set_index("collective")
    before = grouped.nth(-2).set_index("collective")["arrive_ns"].reindex(last.index)
    lead = (last["arrive_ns"] - before.fillna(last["arrive_ns"])).to_numpy(np.int64)
    return pd.DataFrame({"collective": last.index.to_numpy(np.int64), "last_rank": last["rank"].to_numpy(np.int64),
                         "last_arrive_ns": last["arrive_ns"].to_numpy(np.int64), "lead_ns": lead,
                         "exit_ns": grouped["exit_ns"].max().reindex(last.index).to_numpy(np.int64)})


def waits_for(waits: pd.DataFrame, last: pd.DataFrame) -> pd.DataFrame:
    """Per wait (WAIT_COLUMNS), its collective and the rank it waited for until when:
    (rank, interval, collective, straggler, until_ns); collective -1 where none matched,
    straggler -1 where it waited for nobody in particular (its rank
    was the last itself, or the lead was below MIN_LEAD_NS)."""
    ends = last["exit_ns"].to_numpy(np.int64)
    order = np.argsort(ends, kind="stable")
    # The collective of each wait: the first whose exit is at or after its call's.
    at = np.searchsorted(ends[order], waits["exit_ns"].to_numpy(np.int64), side="left")
    ok = at < len(order)
    row = order[np.minimum(at, len(order) - 1)] if len(order) else np.zeros(len(waits), np.int64)
    pick = (lambda column: np.where(ok, last[column].to_numpy(np.int64)[row], -1)) if len(order) else \
        (lambda column: np.full(len(waits), -1, np.int64))
    straggler, until, lead = pick("last_rank"), pick("last_arrive_ns"), pick("lead_ns")
    rank = waits["rank"].to_numpy(np.int64)
    straggler = np.where((straggler == rank) | (lead < MIN_LEAD_NS), -1, straggler)
    return pd.DataFrame({"rank": rank, "interval": waits["interval"].to_numpy(np.int64), "collective": pick("collective"),
                         "straggler": straggler, "until_ns": until})


def rank_summary(arrivals: pd.DataFrame, last: pd.DataFrame, ranks: list[int]) -> pd.DataFrame:
    """Per rank: collectives, waited_ns (arrival to exit), last (collectives it arrived
    last in by MIN_LEAD_NS or more), last_share, others_waited_ns (the other ranks' time
    from their arrival to its own, where it was last)."""
    a = arrivals.assign(waited_ns=(arrivals["exit_ns"] - arrivals["arrive_ns"]).clip(lower=0))
    counted = last[last["lead_ns"] >= MIN_LEAD_NS]
    joined = a.merge(counted[["collective", "last_rank", "last_arrive_ns"]], on="collective")
    joined = joined[joined["rank"] != joined["last_rank"]]
    held = (joined["last_arrive_ns"] - joined["arrive_ns"]).clip(lower=0).groupby(joined["last_rank"]).sum()
    out = pd.DataFrame({"rank": np.asarray(sorted(ranks), np.int64)})
    out["collectives"] = a.groupby("rank")["collective"].nunique().reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    out["waited_ns"] = a.groupby("rank")["waited_ns"].sum().reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    out["last"] = counted["last_rank"].value_counts().reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    n = max(1, int(last["collective"].nunique()))
    out["last_share"] = out["last"] / n
    out["others_waited_ns"] = held.reindex(out["rank"]).fillna(0).to_numpy(np.int64)
    return out
