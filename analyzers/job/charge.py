"""Charging a job's waits inside collectives to the rank they waited for
(docs/findings.md, "Multi-process jobs").

Rank r waits in collective k from its arrival until the last rank's, s's: that part of
its wait is s's fault, the rest is the collective's own communication.  What made s
late is what it did in that step (from collective k-1's exit to its arrival) beyond what
the others did in theirs: per category, s's time less the waiting ranks' median time,
where positive.  The waiting part is shared out over s's pieces of the step in those
categories in proportion to that excess, so a rank that decoded its own batches for
30 ms while every rank spent 40 ms on its GPU step is charged for the decoding, not for
the GPU step it was in when the others arrived."""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import CATEGORIES, CATEGORY_DTYPE
from trainbpf.analyzers.findings.ranking import ATTRIBUTED_COLUMNS
from trainbpf.analyzers.vocab import codes

# One rank's pieces: (trainer tid, its starved pieces, its timeline), findings.ATTRIBUTED_COLUMNS each.
RankPieces = tuple[int, pd.DataFrame, pd.DataFrame]


class _Timeline:
    """One rank's timeline pieces outside its own collective waits, by time, for sums of
    each category's ns over windows."""

    def __init__(self, timeline: pd.DataFrame, own_waits: np.ndarray):
        tl = timeline[~np.isin(timeline["interval"].to_numpy(np.int64), own_waits)]
        self.rows = tl.sort_values(["start_ns", "end_ns"], kind="stable").reset_index(drop=True)
        self.start = self.rows["start_ns"].to_numpy(np.int64)
        self.end = self.rows["end_ns"].to_numpy(np.int64)
        self.reach = np.maximum.accumulate(self.end) if len(self.end) else self.end
        self.density = self.rows["ns"].to_numpy(np.float64) / np.maximum(self.end - self.start, 1)
        self.category = codes(self.rows["category"]).astype(np.int64)

    def within(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows overlapping [lo, hi) and their ns inside it."""
        first = int(np.searchsorted(self.reach, lo, side="right"))
        last = int(np.searchsorted(self.start, hi, side="left"))
        rows = np.arange(first, max(first, last))
        inside = (np.minimum(self.end[rows], hi) - np.maximum(self.start[rows], lo)).clip(min=0) * self.density[rows]
        return rows, inside

    def per_category(self, lo: int, hi: int) -> np.ndarray:
        rows, inside = self.within(lo, hi)
        return np.bincount(self.category[rows], weights=inside, minlength=len(CATEGORIES))

    def between(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """per_category over many windows [lo, hi) at once: (windows, CATEGORIES).  A
        piece adds density x (min(t, end) - start) to its category's ns before t, where
        it started before t: sums over the pieces started, less those ended, before t."""
        used, category = np.unique(self.category, return_inverse=True)
        base = int(self.start[0]) if len(self.start) else 0
        start, end = (self.start - base).astype(np.float64), (self.end - base).astype(np.float64)
        weight = np.zeros((len(start), len(used)))
        weight[np.arange(len(start)), category] = self.density
        by_end = np.argsort(end, kind="stable")
        zero = np.zeros((1, len(used)))
        started, started_at = (np.concatenate([zero, np.cumsum(w, axis=0)]) for w in (weight, weight * start[:, None]))
        ended, ended_at = (np.concatenate([zero, np.cumsum(w, axis=0)])
                           for w in (weight[by_end], weight[by_end] * end[by_end][:, None]))

        def before(t: np.ndarray) -> np.ndarray:
            t = (t - base).astype(np.float64)
            a, b = np.searchsorted(start, t, side="left"), np.searchsorted(end[by_end], t, side="left")
            return t[:, None] * (started[a] - ended[b]) - (started_at[a] - ended_at[b])

        out = np.zeros((len(lo), len(CATEGORIES)))
        out[:, used] = np.clip(before(np.maximum(hi, lo)) - before(lo), 0.0, None)
        return out


def charge(ranks: dict[int, RankPieces], waits: pd.DataFrame, arrivals: pd.DataFrame, last: pd.DataFrame) -> pd.DataFrame:
    """The job's attributed pieces (ATTRIBUTED_COLUMNS + rank, culprit_rank): each
    rank's own, and its waits inside collectives (`waits`: collectives.waits_for's) split
    into the part charged to the straggler's excess in that step and `collective`."""
    own_waits = {int(r): w["interval"].to_numpy(np.int64) for r, w in waits.groupby("rank")}
    none = np.zeros(0, np.int64)
    since = _step_starts(last)
    arrive = arrivals.set_index(["collective", "rank"])["arrive_ns"]
    out, owed = _split_waits(ranks, waits)
    owed = owed[owed["ns"] > 0].groupby(["collective", "straggler", "rank"], as_index=False)["ns"].sum()
    theirs = _their_steps(owed, ranks, own_waits, since, arrive)
    trainers = {r: t for r, (t, _, _) in ranks.items()}
    timelines: dict[int, _Timeline] = {}
    for (k, s), rows in owed.groupby(["collective", "straggler"], sort=False).indices.items():
        if s not in timelines:
            timelines[s] = _Timeline(ranks[int(s)][2], own_waits.get(int(s), none))
        out.append(_charged(int(k), int(s), owed.iloc[rows], np.median(theirs[rows], axis=0), timelines[s], since,
                            arrive, trainers))
    job = pd.concat(out, ignore_index=True)
    job = job[job["ns"] > 0]
    return job.sort_values("start_ns", kind="stable").reset_index(drop=True)


def _split_waits(ranks: dict[int, RankPieces], waits: pd.DataFrame) -> tuple[list[pd.DataFrame], pd.DataFrame]:
    """Every rank's starved pieces, those outside its collective waits as they are and
    the rest of its waits as `collective` (ATTRIBUTED_COLUMNS + rank, culprit_rank), and
    what each wait owes the rank it waited for (rank, collective, straggler, ns): its time
    from its arrival to the straggler's."""
    st = pd.concat([starved.assign(rank=rank) for rank, (_, starved, _) in ranks.items()], ignore_index=True)
    st["culprit_rank"] = st["rank"]
    at = st[["rank", "interval"]].merge(waits.drop_duplicates(["rank", "interval"]), on=["rank", "interval"], how="left")
    inside = at["collective"].notna().to_numpy()
    coll, hit = st[inside], at[inside]
    straggler, until = hit["straggler"].to_numpy(np.int64), hit["until_ns"].to_numpy(np.int64)
    start, end = coll["start_ns"].to_numpy(np.int64), coll["end_ns"].to_numpy(np.int64)
    frac = np.where((straggler >= 0) & (end > start), (np.clip(until, start, end) - start) / np.maximum(end - start, 1), 0.0)
    ns = coll["ns"].to_numpy(np.float64)
    owed = pd.DataFrame({"rank": coll["rank"].to_numpy(np.int64), "collective": hit["collective"].to_numpy(np.int64),
                         "straggler": straggler, "ns": ns * frac})
    trainer = pd.Series({r: t for r, (t, _, _) in ranks.items()}, dtype=np.int64)
    rest = coll.assign(ns=ns * (1.0 - frac), root_tid=trainer.reindex(coll["rank"]).to_numpy(np.int64), end=-1,
                       category=pd.Categorical(["collective"] * len(coll), dtype=CATEGORY_DTYPE))
    return [st[~inside], rest], owed


def _their_steps(owed: pd.DataFrame, ranks: dict[int, RankPieces], own_waits: dict[int, np.ndarray],
                 since: pd.Series, arrive: pd.Series) -> np.ndarray:
    """Per row of `owed` (a waiting rank in a collective), what that rank did in its
    step, per category: its timeline from the step's start to its own arrival."""
    out = np.zeros((len(owed), len(CATEGORIES)))
    collective = owed["collective"].to_numpy(np.int64)
    for rank, rows in owed.groupby("rank").indices.items():
        k = collective[rows]
        lo = since.reindex(k).to_numpy(np.int64)
        hi = arrive.reindex(pd.MultiIndex.from_arrays([k, np.full(len(k), rank)])).to_numpy(np.float64)
        hi = np.where(np.isnan(hi), lo, hi).astype(np.int64)
        out[rows] = _Timeline(ranks[int(rank)][2], own_waits.get(int(rank), np.zeros(0, np.int64))).between(lo, hi)
    return out


def _step_starts(last: pd.DataFrame) -> pd.Series:
    """Per collective, where its step began: the previous collective's exit (the first:
    one typical step before its last arrival; with one collective, the beginning)."""
    ordered = last.sort_values("exit_ns", kind="stable")
    prev = ordered["exit_ns"].shift(1)
    spacing = float(ordered["exit_ns"].diff().median()) if len(ordered) > 1 else 0.0
    first = ordered["last_arrive_ns"] - spacing if spacing > 0 else pd.Series(0, index=ordered.index)
    return pd.Series(prev.fillna(first).to_numpy(np.int64), index=ordered["collective"].to_numpy())


def _charged(k: int, s: int, owed: pd.DataFrame, theirs: np.ndarray, mine: _Timeline, since: pd.Series,
             arrive: pd.Series, trainers: dict[int, int]) -> pd.DataFrame:
    """The straggler s's pieces of step k (`mine`: its timeline) in the categories it
    spent more time on than the ranks that waited for it (`theirs`: their median time
    per category), carrying what each waiting rank (`owed`: rank, ns) is charged; where
    it spent more on nothing, the owed time stays `collective`."""
    lo, hi = int(since[k]), int(arrive[(k, s)])
    waiting, owed_ns = owed["rank"].to_numpy(np.int64), owed["ns"].to_numpy(np.float64)
    excess = np.maximum(mine.per_category(lo, hi) - theirs, 0.0)
    rows, inside = mine.within(lo, hi)
    spent = np.bincount(mine.category[rows], weights=inside, minlength=len(CATEGORIES))
    weight = inside * np.divide(excess, spent, out=np.zeros(len(excess)), where=spent > 0)[mine.category[rows]]
    if weight.sum() <= 0:
        return pd.DataFrame({"start_ns": lo, "end_ns": hi, "ns": owed_ns, "state": "other",
                             "category": pd.Categorical(["collective"] * len(owed), dtype=CATEGORY_DTYPE),
                             "root_tid": [trainers[int(r)] for r in waiting], "interval": -1, "end": -1,
                             "rank": waiting, "culprit_rank": waiting})
    used = rows[weight > 0]
    weight = weight[weight > 0] / weight.sum()
    # Every waiting rank's share of every one of those pieces: one row per (rank, piece).
    pieces = mine.rows.iloc[np.tile(used, len(waiting))][list(ATTRIBUTED_COLUMNS)]
    return pieces.assign(start_ns=np.maximum(pieces["start_ns"].to_numpy(), lo),
                         end_ns=np.minimum(pieces["end_ns"].to_numpy(), hi), ns=np.outer(owed_ns, weight).ravel(),
                         rank=np.repeat(waiting, len(used)), culprit_rank=s)
