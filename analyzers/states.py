"""Per-thread state intervals: every observed ns of every thread in exactly one state.

From the scheduler's view alone: an ``offcpu`` row is a blocked part (switch-out to
wake-up) followed by a runnable tail (``runq_ns``); the gaps between them are running.
``offcpu_short`` sums (waits below the recorder's threshold) are carved out of the running
gaps they were flushed after.  Attribution (attribution.py) later renames blocked parts by
the cause the kernel evidence shows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.categories import STATE_DTYPE, STATES, codes
from trainbpf.analyzers.intervals import NS_PER_S, Span, as_int64, dense_rank, intersect, sort_by_thread

STATE_COLUMNS = ("tid", "start_ns", "end_ns", "state", "waker_tid", "kstack_id", "ustack_id")

_CODE = {name: i for i, name in enumerate(STATES)}
# Per offcpu row the states follow in this order: running gap, the short waits carved
# from it, the blocked part, the runnable tail.
_PARTS = 5


def empty_states() -> pd.DataFrame:
    return _frame(*(np.zeros(0, np.int64) for _ in range(7)))


def _frame(tid, start, end, code, waker, kstack, ustack) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "tid": np.asarray(tid, dtype=np.int32),
            "start_ns": np.asarray(start, dtype=np.int64),
            "end_ns": np.asarray(end, dtype=np.int64),
            "state": pd.Categorical.from_codes(np.asarray(code, dtype=np.int8), dtype=STATE_DTYPE),
            "waker_tid": np.asarray(waker, dtype=np.int32),
            "kstack_id": np.asarray(kstack, dtype=np.int32),
            "ustack_id": np.asarray(ustack, dtype=np.int32),
        },
        copy=False,
    )


def _sched_codes(sched_state: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Per row, what the scheduler's state letter alone says about the blocked part
    (a state code) and whether the thread was preempted ("R").  Letters are decoded once
    per distinct value."""
    values, uniques = pd.factorize(sched_state)
    letters = [str(u)[:1] for u in uniques] + [""]  # the last entry serves nulls (-1)
    blocked = np.array(
        [_CODE["sleep"] if x in ("S", "I") else _CODE["uninterruptible"] if x == "D" else _CODE["other"] for x in letters],
        dtype=np.int8,
    )
    preempted = np.array([x == "R" for x in letters])
    return blocked[values], preempted[values]


def _positions(tid: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each key in the sorted unique `tid` array, and whether it is there."""
    pos = np.minimum(np.searchsorted(tid, keys), max(len(tid) - 1, 0))
    return pos, (tid[pos] == keys) if len(tid) else np.zeros(len(keys), bool)


def thread_states(offcpu: pd.DataFrame, offcpu_short: pd.DataFrame, threads: pd.DataFrame) -> pd.DataFrame:
    """State intervals of every thread in `threads`, over its observed life
    [first_ns, last_ns), sorted by (tid, start_ns)."""
    if not len(threads):
        return empty_states()
    t_tid = threads["tid"].to_numpy(np.int64)
    order = np.argsort(t_tid)
    t_tid = t_tid[order]
    t_first = threads["first_ns"].to_numpy(np.int64)[order]
    t_last = threads["last_ns"].to_numpy(np.int64)[order]

    pos, known = _positions(t_tid, as_int64(offcpu["tid"]))
    everyone = bool(known.all())

    def column(name: str, fill: int = -1) -> np.ndarray:
        """An offcpu column of the rows of known threads (usually all: no copy then)."""
        values = as_int64(offcpu[name], fill)
        return values if everyone else values[known]

    pos = pos if everyone else pos[known]
    ts = column("ts_ns")
    dur = np.maximum(column("dur_ns", 0), 0)
    blocked_code, preempted = _sched_codes(offcpu["state"])
    if not everyone:
        blocked_code, preempted = blocked_code[known], preempted[known]
    runq = np.where(preempted, dur, np.minimum(np.maximum(column("runq_ns", 0), 0), dur))
    first, last = t_first[pos], t_last[pos]
    start = np.minimum(np.maximum(ts, first), last)
    end = np.minimum(np.maximum(ts + dur, first), last)
    wake = np.minimum(np.maximum(ts + dur - runq, start), end)
    del ts, dur, runq, first, last

    # One virtual row per thread at its end carries the tail running gap; appended last,
    # a stable sort keeps it after any real row that starts at the same time.
    n_rows = len(pos)
    pos = np.concatenate([pos, np.arange(len(t_tid))])
    start = np.concatenate([start, t_last])
    order = sort_by_thread(pos, start)
    pos, start = pos[order], start[order]
    wake = np.concatenate([wake, t_last])[order]
    end = np.concatenate([end, t_last])[order]
    src = np.where(order < n_rows, order, -1)  # offcpu row (among known ones) behind each slot
    del order

    new_thread = np.ones(len(pos), bool)
    new_thread[1:] = pos[1:] != pos[:-1]
    prev_end = np.empty_like(end)
    prev_end[1:] = end[:-1]
    prev_end[new_thread] = t_first[pos[new_thread]]
    if (start < prev_end).any():
        # Overlapping rows (inconsistent input) lose their overlap to the earlier rows.
        reach = pd.Series(end).groupby(pos, sort=False).cummax().to_numpy()
        prev_end[1:] = reach[:-1]
        prev_end[new_thread] = t_first[pos[new_thread]]
        start = np.maximum(start, prev_end)
        end = np.maximum(end, start)
        wake = np.minimum(np.maximum(wake, start), end)

    short_blk, short_rq = _carve_short(offcpu_short, t_tid[pos], prev_end, start)
    run_end = start - short_blk - short_rq
    # Each slot is up to five consecutive parts; empty parts are left out.
    edges = (prev_end, run_end, run_end + short_blk, start, wake, end)
    kept = [edges[p + 1] > edges[p] for p in range(_PARTS)]
    counts = np.zeros(len(pos), dtype=np.int64)
    for k in kept:
        counts += k
    offset = np.cumsum(counts) - counts
    total = int(counts.sum())
    out_start = np.empty(total, np.int64)
    out_end = np.empty(total, np.int64)
    out_code = np.empty(total, np.int8)
    waker = np.full(total, -1, np.int32)
    kstack = np.full(total, -1, np.int32)
    ustack = np.full(total, -1, np.int32)
    part_code = (_CODE["running"], _CODE["short_wait"], _CODE["runnable"], None, _CODE["runnable"])
    row_waker = column("peer_tid")
    for p in range(_PARTS):
        k = kept[p]
        at = offset[k]
        out_start[at] = edges[p][k]
        out_end[at] = edges[p + 1][k]
        rows = src[k]
        real = rows >= 0
        if p == 3:  # the blocked part: its cause so far, its waker, stacks at switch-out
            out_code[at] = np.where(real, blocked_code[np.maximum(rows, 0)] if n_rows else 0, _CODE["other"])
            waker[at[real]] = row_waker[rows[real]]
            kstack[at[real]] = column("kstack_id")[rows[real]]
            ustack[at[real]] = column("ustack_id")[rows[real]]
        else:
            out_code[at] = part_code[p]
        if p == 4:  # the runnable tail after a wake-up
            waker[at[real]] = row_waker[rows[real]]
        offset[k] += 1
    return _frame(np.repeat(t_tid[pos], counts), out_start, out_end, out_code, waker, kstack, ustack)


def _carve_short(short: pd.DataFrame, tid: np.ndarray, gap_start: np.ndarray, gap_end: np.ndarray):
    """ns of each running gap that were short waits (blocked, runnable).

    A flush reports the short waits since the previous flush of that thread; they are
    spread over the running time inside that period in proportion, never more than it.
    `tid` is sorted, so each thread's gaps are one contiguous range."""
    zeros = np.zeros(len(tid), np.float64)
    out_blk, out_rq = zeros, zeros.copy()
    if not len(short) or not len(tid):
        return out_blk.astype(np.int64), out_rq.astype(np.int64)
    dur = np.maximum(as_int64(short["dur_ns"], 0), 0)
    runq = np.clip(as_int64(short["runq_ns"], 0), 0, dur)
    preempted = _sched_codes(short["state"])[1]
    runq = np.where(preempted, dur, runq)
    flushes = (
        pd.DataFrame({"tid": as_int64(short["tid"]), "flush_ns": as_int64(short["ts_ns"]), "blk": dur - runq, "rq": runq})
        .groupby(["tid", "flush_ns"], as_index=False)[["blk", "rq"]].sum()
    )
    for thread, f in flushes.groupby("tid", sort=False):  # a loop over threads, not events
        lo, hi = np.searchsorted(tid, thread, side="left"), np.searchsorted(tid, thread, side="right")
        if lo == hi:
            continue
        period_end = f["flush_ns"].to_numpy(np.int64)
        period_start = np.concatenate([[np.iinfo(np.int64).min], period_end[:-1]])
        gi, pi, s, e = intersect(gap_start[lo:hi], gap_end[lo:hi], period_start, period_end)
        overlap = (e - s).astype(np.float64)
        running = np.bincount(pi, weights=overlap, minlength=len(period_end)).astype(np.float64)
        blk, rq = f["blk"].to_numpy(np.float64), f["rq"].to_numpy(np.float64)
        share = np.divide(blk, blk + rq, out=np.zeros_like(blk), where=(blk + rq) > 0)
        # Each period's short waits, capped at its running time, spread over its gaps.
        fraction = np.divide(np.minimum(blk + rq, running), running, out=np.zeros_like(running), where=running > 0)
        carved = overlap * fraction[pi]
        out_blk[lo:hi] += np.bincount(gi, weights=carved * share[pi], minlength=hi - lo)
        out_rq[lo:hi] += np.bincount(gi, weights=carved * (1.0 - share[pi]), minlength=hi - lo)
    length = gap_end - gap_start
    blk_ns = np.minimum(np.floor(out_blk).astype(np.int64), length)
    rq_ns = np.minimum(np.floor(out_rq).astype(np.int64), length - blk_ns)
    return blk_ns, rq_ns


def clipped_lengths(states: pd.DataFrame, span: Span) -> np.ndarray:
    """Each interval's ns inside `span` (0 outside it)."""
    start = np.maximum(states["start_ns"].to_numpy(), span.start_ns)
    end = np.minimum(states["end_ns"].to_numpy(), span.end_ns)
    return np.maximum(end - start, 0)


TOTAL_COLUMNS = ("tid", "state", "ns")


def state_totals(states: pd.DataFrame, span: Span | None = None) -> pd.DataFrame:
    """ns per (tid, state) inside `span` (default: everything), states with time only;
    long form, sorted by tid then state."""
    tid = states["tid"].to_numpy(np.int64)
    if span is None:
        ns = (states["end_ns"] - states["start_ns"]).to_numpy(np.int64)
    else:
        ns = clipped_lengths(states, span)
    tids, rank = dense_rank(tid)
    n_states = len(STATES)
    sums = np.bincount(rank.astype(np.int64) * n_states + codes(states["state"]), weights=ns, minlength=len(tids) * n_states)
    sums = np.rint(sums).astype(np.int64)
    hit = np.flatnonzero(sums > 0)
    return pd.DataFrame({
        "tid": tids[hit // n_states].astype(np.int64),
        "state": pd.Categorical.from_codes(hit % n_states, dtype=STATE_DTYPE),
        "ns": sums[hit],
    })[list(TOTAL_COLUMNS)]


def state_seconds(totals: pd.DataFrame) -> dict[int, dict[str, float]]:
    """{tid: {state: seconds}} in the fixed state order, states with time only."""
    out: dict[int, dict[str, float]] = {}
    for tid, group in totals.groupby("tid", sort=True):
        ns = dict(zip(group["state"].astype(str), group["ns"]))
        out[int(tid)] = {s: ns[s] / NS_PER_S for s in STATES if ns.get(s, 0) > 0}
    return out
