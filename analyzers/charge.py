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

from trainbpf.analyzers.categories import CATEGORIES, CATEGORY_DTYPE
from trainbpf.analyzers.findings import ATTRIBUTED_COLUMNS
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


def charge(ranks: dict[int, RankPieces], waits: pd.DataFrame, arrivals: pd.DataFrame, last: pd.DataFrame
           ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The job's attributed pieces (ATTRIBUTED_COLUMNS + rank, culprit_rank): each
    rank's own, and its waits inside collectives (`waits`: collectives.waits_for's) split
    into the part charged to the straggler's excess in that step and `collective`; and
    what the stragglers did that the others waited for (ATTRIBUTED_COLUMNS + rank, the
    straggler's: its pieces of those steps in the categories charged, ns as spent)."""
    own_waits = {rank: waits.loc[waits["rank"] == rank, "interval"].to_numpy(np.int64) for rank in ranks}
    timelines = {rank: _Timeline(tl, own_waits[rank]) for rank, (_, _, tl) in ranks.items()}
    since = _step_starts(last)
    arrive = arrivals.set_index(["collective", "rank"])["arrive_ns"]
    out, owed = [], []
    for rank, (trainer, starved, _) in ranks.items():
        st = starved.assign(rank=rank, culprit_rank=rank)
        mine = waits[waits["rank"] == rank].drop_duplicates("interval").set_index("interval")
        iv = st["interval"].to_numpy(np.int64)
        inside = np.isin(iv, mine.index.to_numpy())
        out.append(st[~inside])
        coll = st[inside]
        straggler = mine["straggler"].reindex(iv[inside]).to_numpy(np.int64)
        until = mine["until_ns"].reindex(iv[inside]).to_numpy(np.int64)
        start, end = coll["start_ns"].to_numpy(np.int64), coll["end_ns"].to_numpy(np.int64)
        frac = np.where((straggler >= 0) & (end > start), (np.clip(until, start, end) - start) / np.maximum(end - start, 1), 0.0)
        ns = coll["ns"].to_numpy(np.float64)
        owed.append(pd.DataFrame({"rank": rank, "collective": mine["collective"].reindex(iv[inside]).to_numpy(np.int64),
                                  "straggler": straggler, "ns": ns * frac}))
        rest = coll.assign(ns=ns * (1.0 - frac), root_tid=int(trainer), end=-1)
        rest["category"] = pd.Categorical(["collective"] * len(rest), dtype=CATEGORY_DTYPE)
        out.append(rest)
    owed = pd.concat(owed, ignore_index=True)
    owed = owed[owed["ns"] > 0].groupby(["collective", "straggler", "rank"], as_index=False)["ns"].sum()
    held = []
    for (k, s), group in owed.groupby(["collective", "straggler"], sort=False):
        charged, spent = _charged(int(k), int(s), group, timelines, since, arrive, ranks)
        out.append(charged)
        held.append(spent)
    job = pd.concat(out, ignore_index=True)
    job = job[job["ns"] > 0]
    spent = pd.concat(held, ignore_index=True) if held else job.iloc[:0].drop(columns="culprit_rank")
    return job.sort_values("start_ns", kind="stable").reset_index(drop=True), spent[spent["ns"] > 0]


def _step_starts(last: pd.DataFrame) -> pd.Series:
    """Per collective, where its step began: the previous collective's exit (the first:
    one typical step before its last arrival; with one collective, the beginning)."""
    ordered = last.sort_values("exit_ns", kind="stable")
    prev = ordered["exit_ns"].shift(1)
    spacing = float(ordered["exit_ns"].diff().median()) if len(ordered) > 1 else 0.0
    first = ordered["last_arrive_ns"] - spacing if spacing > 0 else pd.Series(0, index=ordered.index)
    return pd.Series(prev.fillna(first).to_numpy(np.int64), index=ordered["collective"].to_numpy())


def _charged(k: int, s: int, owed: pd.DataFrame, timelines: dict[int, _Timeline], since: pd.Series,
             arrive: pd.Series, ranks: dict[int, RankPieces]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The straggler s's pieces of step k in the categories it spent more time on than
    the ranks that waited for it, carrying what each waiting rank (`owed`: rank, ns) is
    charged, and the same pieces with the ns s spent in them; where it spent more on
    nothing, the owed time stays `collective`."""
    lo, hi = int(since[k]), int(arrive[(k, s)])
    mine = timelines[s]
    theirs = [timelines[r].per_category(lo, int(arrive[(k, r)])) for r in owed["rank"] if (k, r) in arrive.index]
    excess = np.maximum(mine.per_category(lo, hi) - (np.median(theirs, axis=0) if theirs else 0.0), 0.0)
    rows, inside = mine.within(lo, hi)
    spent = np.bincount(mine.category[rows], weights=inside, minlength=len(CATEGORIES))
    weight = inside * np.divide(excess, spent, out=np.zeros(len(excess)), where=spent > 0)[mine.category[rows]]
    if weight.sum() <= 0:
        trainer = {r: t for r, (t, _, _) in ranks.items()}
        return pd.DataFrame({"start_ns": lo, "end_ns": hi, "ns": owed["ns"].to_numpy(), "state": "other",
                             "category": pd.Categorical(["collective"] * len(owed), dtype=CATEGORY_DTYPE),
                             "root_tid": [trainer[int(r)] for r in owed["rank"]], "interval": -1, "end": -1,
                             "rank": owed["rank"].to_numpy(), "culprit_rank": owed["rank"].to_numpy()}), \
            mine.rows.iloc[:0][list(ATTRIBUTED_COLUMNS)].assign(rank=s)
    pieces = mine.rows.iloc[rows][list(ATTRIBUTED_COLUMNS)]
    spent = pieces.assign(start_ns=np.maximum(pieces["start_ns"].to_numpy(), lo),
                          end_ns=np.minimum(pieces["end_ns"].to_numpy(), hi), ns=inside * (weight > 0), rank=s)
    weight = weight / weight.sum()
    parts = []
    for r, ns in zip(owed["rank"].to_numpy(np.int64), owed["ns"].to_numpy(np.float64)):
        parts.append(pieces.assign(start_ns=np.maximum(pieces["start_ns"].to_numpy(), lo),
                                   end_ns=np.minimum(pieces["end_ns"].to_numpy(), hi), ns=ns * weight,
                                   rank=int(r), culprit_rank=s))
    return pd.concat(parts, ignore_index=True), spent
