"""Per-thread state intervals: every observed ns of every thread in exactly one state.

From the scheduler's view alone: an ``offcpu`` row is a blocked part (switch-out to
wake-up) followed by a runnable tail (``runq_ns``); the gaps between them are running.
``offcpu_short`` sums (waits below the recorder's threshold) are carved out of the running
gaps they were flushed after.  Attribution (attribution.py) later renames blocked parts by
the cause the kernel evidence shows.

The intervals are held as slots: one per offcpu row, plus one per thread for the running
gap at the end of its life, each five consecutive parts (the running gap before the row,
the short waits carved from it, blocked then runnable, the row's blocked part, its
runnable tail) given by six edges.  Slots take under half the memory of the intervals
they stand for, and the analyzers read them directly; `expand_slots` gives the intervals
themselves (STATE_COLUMNS), one row per non-empty part.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.analyzers.intervals import (
    NS_PER_S,
    Span,
    as_int64,
    dense_rank,
    in_thread_order,
    intersect,
    row_chunks,
    run_parallel,
    sort_by_thread,
)
from trainbpf.analyzers.vocab import FUTEX_CLASS_DTYPE, STATE_DTYPE, STATES, codes

STATE_COLUMNS = ("tid", "start_ns", "end_ns", "state", "waker_tid", "kstack_id", "ustack_id")
# Where each part of a slot starts, and where the last one ends.
SLOT_EDGES = ("start_ns", "short_ns", "queued_ns", "switch_out_ns", "wake_ns", "end_ns")
# `state` names the blocked part; waker_tid ended it (and so applies to the runnable tail
# too), the stacks were taken at its switch-out.
SLOT_COLUMNS = ("tid", *SLOT_EDGES, "state", "waker_tid", "kstack_id", "ustack_id")
# The offcpu columns of the ids slots carry (peer_tid as waker_tid).
_ID_COLUMNS = ("peer_tid", "kstack_id", "ustack_id")
# Slots and state intervals from offcpu rows read with Python stack ids (a trace that has
# Python stacks) carry them too, -1 where none was taken: the thread's at the switch-out
# (where it resumes, so the runnable tail's as well) and the waker's at the wake-up.
# Other traces go without: two columns of -1 would cost 8 bytes a slot.
PYTHON_ID_COLUMNS = ("pystack_id", "peer_pystack_id")

_CODE = {name: i for i, name in enumerate(STATES)}
# The state of each part of a slot; the blocked part's is the slot's `state`.
BLOCKED_PART = 3
PART_CODES = np.array([_CODE["running"], _CODE["short_wait"], _CODE["runnable"], -1, _CODE["runnable"]], dtype=np.int8)
_PARTS = len(PART_CODES)
# The part a state interval is when it stands alone in a slot (as_slots).
_PART_OF_STATE = np.full(len(STATES), BLOCKED_PART, dtype=np.int8)
_PART_OF_STATE[[_CODE["running"], _CODE["short_wait"], _CODE["runnable"]]] = (0, 1, 2)
# state_slots works through whole threads about this many offcpu rows at a time, so its
# temporaries stay small beside its output.
CHUNK_OFFCPU_ROWS = 1 << 18


def _slots_frame(tid, edges, code, waker, kstack, ustack, **python) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "tid": np.asarray(tid, dtype=np.int32),
            **{name: np.asarray(e, dtype=np.int64) for name, e in zip(SLOT_EDGES, edges)},
            "state": pd.Categorical.from_codes(np.asarray(code, dtype=np.int8), dtype=STATE_DTYPE),
            "waker_tid": np.asarray(waker, dtype=np.int32),
            "kstack_id": np.asarray(kstack, dtype=np.int32),
            "ustack_id": np.asarray(ustack, dtype=np.int32),
            **{name: np.asarray(ids, dtype=np.int32) for name, ids in python.items()},
        },
        copy=False,
    )


def _sched_codes(sched_state: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Per row, what the scheduler's state letter alone says about the blocked part
    (a state code) and whether the thread was preempted ("R").  Letters are decoded once
    per distinct value."""
    column = pa.array(sched_state, type=pa.large_string(), from_pandas=True)
    encoded = pc.dictionary_encode(column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column)
    values = pc.fill_null(encoded.indices, -1).to_numpy()
    letters = [str(u)[:1] for u in encoded.dictionary.to_pylist()] + [""]  # the last entry serves nulls (-1)
    blocked = np.array(
        [_CODE["sleep"] if x in ("S", "I") else _CODE["uninterruptible"] if x == "D" else _CODE["other"] for x in letters],
        dtype=np.int8,
    )
    preempted = np.array([x == "R" for x in letters])
    return blocked[values], preempted[values]


def _positions(tid: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of each key in the sorted unique `tid` array, -1 where it is not there."""
    if len(tid) and tid[0] >= 0 and tid[-1] < 1 << 24:  # small ids: a lookup table
        table = np.full(int(tid[-1]) + 2, -1, dtype=np.int32)
        table[tid] = np.arange(len(tid))
        return table[np.clip(keys, -1, len(table) - 1)]
    pos = np.minimum(np.searchsorted(tid, keys), max(len(tid) - 1, 0))
    return np.where(tid[pos] == keys, pos, -1) if len(tid) else np.full(len(keys), -1)


def state_slots(offcpu: pd.DataFrame, offcpu_short: pd.DataFrame, threads: pd.DataFrame) -> pd.DataFrame:
    """The state slots (SLOT_COLUMNS, and PYTHON_ID_COLUMNS where `offcpu` has them) of
    every thread in `threads`, over its observed life [first_ns, last_ns), sorted by
    (tid, start_ns); a thread's slots tile its life."""
    t_tid = threads["tid"].to_numpy(np.int64)
    order = np.argsort(t_tid)
    t_tid = t_tid[order]
    t_first = threads["first_ns"].to_numpy(np.int64)[order]
    t_last = threads["last_ns"].to_numpy(np.int64)[order]

    # The offcpu rows of known threads in (thread, start) order, start clipped to the life
    # (None: all of them, in that order already; clipping keeps it).
    pos = _positions(t_tid, offcpu["tid"].to_numpy())
    ts = as_int64(offcpu["ts_ns"])
    rows = None
    if not (len(pos) and pos.min() >= 0 and in_thread_order(pos, ts)):
        rows = np.flatnonzero(pos >= 0)
        pos = pos[rows]
        order = sort_by_thread(pos, np.minimum(np.maximum(ts[rows], t_first[pos]), t_last[pos]))
        rows, pos = rows[order], pos[order]
        del order
    python = tuple(name for name in PYTHON_ID_COLUMNS if name in offcpu)
    blocked_code, preempted = _sched_codes(offcpu["state"])
    flushes = _short_flushes(offcpu_short)
    # The columns the slots take, as plain arrays (views where they have no nulls).
    columns = {"ts": ts, "dur": as_int64(offcpu["dur_ns"], 0), "runq": as_int64(offcpu["runq_ns"], 0),
               **{name: offcpu[name].to_numpy(dtype=np.int32, na_value=-1) for name in _ID_COLUMNS + python}}

    n = len(pos) + len(t_tid)  # a slot per row, and one per thread after its rows
    out = (np.empty(n, np.int32), np.empty((_PARTS + 1, n), np.int64), np.empty(n, np.int8),
           *(np.empty(n, np.int32) for _ in _ID_COLUMNS + python))
    thread_end = np.searchsorted(pos, np.arange(1, len(t_tid) + 1))  # where each thread's rows end
    jobs = []
    lo = 0
    while lo < len(t_tid):  # whole threads, about CHUNK_OFFCPU_ROWS rows at a time
        a = int(thread_end[lo - 1]) if lo else 0
        hi = min(len(t_tid), max(lo + 1, int(np.searchsorted(thread_end, a + CHUNK_OFFCPU_ROWS, side="right"))))
        b = int(thread_end[hi - 1])
        threads_here = slice(lo, hi)
        jobs.append(partial(
            _fill_slots, [column[..., a + lo:b + hi] for column in out], columns,
            np.arange(a, b) if rows is None else rows[a:b], pos[a:b] - lo, thread_end[threads_here] - a,
            blocked_code, preempted, flushes, t_tid[threads_here], t_first[threads_here], t_last[threads_here],
        ))
        lo = hi
    run_parallel(jobs)  # each writes its own slots
    return _slots_frame(*out[:6], **dict(zip(python, out[6:])))


def _fill_slots(out, columns, rows, pos, thread_end, blocked_code, preempted, flushes, t_tid, t_first, t_last) -> None:
    """Write the slots of some threads (their offcpu `rows`, sorted, each row's thread
    `pos` among them, where each thread's rows end) into `out`."""
    ts = columns["ts"][rows]
    dur = np.maximum(columns["dur"][rows], 0)
    runq = np.where(preempted[rows], dur, np.minimum(np.maximum(columns["runq"][rows], 0), dur))
    first, last = t_first[pos], t_last[pos]
    start = np.minimum(np.maximum(ts, first), last)
    end = np.minimum(np.maximum(ts + dur, first), last)
    wake = np.minimum(np.maximum(ts + dur - runq, start), end)
    del ts, dur, runq, first, last

    # One virtual slot per thread, after its rows, carries the tail running gap.
    pos = np.insert(pos, thread_end, np.arange(len(t_tid)))
    start = np.insert(start, thread_end, t_last)
    wake = np.insert(wake, thread_end, t_last)
    end = np.insert(end, thread_end, t_last)
    src = np.insert(rows, thread_end, -1)  # the offcpu row behind each slot

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

    short_blk, short_rq = _carve_short(flushes, t_tid.tolist(), t_tid[pos], prev_end, start)
    tid, edges, code, *ids = out
    tid[:] = t_tid[pos]
    edges[0] = prev_end
    np.subtract(start, short_blk + short_rq, out=edges[1])
    np.add(edges[1], short_blk, out=edges[2])
    edges[3], edges[4], edges[5] = start, wake, end
    real = src >= 0
    rows = src[real]
    code[:] = _CODE["other"]
    code[real] = blocked_code[rows]
    for into, name in zip(ids, [n for n in _ID_COLUMNS + PYTHON_ID_COLUMNS if n in columns]):
        into[:] = -1
        into[real] = columns[name][rows]


def expand_slots(slots: pd.DataFrame) -> pd.DataFrame:
    """The state intervals (STATE_COLUMNS, and futex_class and PYTHON_ID_COLUMNS when the
    slots have them) the slots stand for: each slot's non-empty parts in order."""
    edges = [slots[name].to_numpy() for name in SLOT_EDGES]
    counts = np.zeros(len(slots), np.int64)
    for part in range(_PARTS):
        counts += edges[part + 1] > edges[part]
    offset = np.cumsum(counts) - counts
    n = int(counts.sum())
    state = codes(slots["state"])
    fclass = codes(slots["futex_class"]) if "futex_class" in slots else None
    tid, start, end, code = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int8)
    python = tuple(name for name in PYTHON_ID_COLUMNS if name in slots)
    ids = {name: np.full(n, -1, np.int32) for name in ("waker_tid", "kstack_id", "ustack_id") + python}
    part_fclass = np.zeros(n, np.int8)
    slot_tid = slots["tid"].to_numpy()
    for rows in row_chunks(len(slots)):
        at = offset[rows].copy()
        for part in range(_PARTS):
            kept = edges[part + 1][rows] > edges[part][rows]
            here = at[kept]
            slot = np.flatnonzero(kept) + rows.start
            tid[here] = slot_tid[slot]
            start[here] = edges[part][slot]
            end[here] = edges[part + 1][slot]
            code[here] = state[slot] if part == BLOCKED_PART else PART_CODES[part]
            if part >= BLOCKED_PART:  # the waker ended the blocked part; the tail followed
                for name in ("waker_tid",) + python:
                    ids[name][here] = slots[name].to_numpy()[slot]
            if part == BLOCKED_PART:
                ids["kstack_id"][here] = slots["kstack_id"].to_numpy()[slot]
                ids["ustack_id"][here] = slots["ustack_id"].to_numpy()[slot]
                if fclass is not None:
                    part_fclass[here] = fclass[slot]
            at[kept] += 1
    out = pd.DataFrame(
        {"tid": tid, "start_ns": start, "end_ns": end, "state": pd.Categorical.from_codes(code, dtype=STATE_DTYPE), **ids},
        copy=False,
    )
    if fclass is not None:
        out["futex_class"] = pd.Categorical.from_codes(part_fclass, dtype=FUTEX_CLASS_DTYPE)
    return out


def as_slots(states: pd.DataFrame) -> pd.DataFrame:
    """Slots as they are, or state intervals (STATE_COLUMNS) as slots of one part each:
    the functions that take states take either."""
    if "switch_out_ns" in states:
        return states
    code = codes(states["state"])
    start, end = states["start_ns"].to_numpy(np.int64), states["end_ns"].to_numpy(np.int64)
    part = _PART_OF_STATE[code]
    out = _slots_frame(
        states["tid"].to_numpy(), [np.where(part >= p, start, end) for p in range(_PARTS + 1)], code,
        *(states[name].to_numpy() if name in states else np.full(len(states), -1) for name in ("waker_tid", "kstack_id", "ustack_id")),
        **{name: states[name].to_numpy() for name in PYTHON_ID_COLUMNS if name in states},
    )
    if "futex_class" in states:
        out["futex_class"] = states["futex_class"].array
    return out


def _short_flushes(short: pd.DataFrame) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per thread, its offcpu_short flushes: (flush_ns sorted, blocked ns, runnable ns)."""
    if not len(short):
        return {}
    dur = np.maximum(as_int64(short["dur_ns"], 0), 0)
    runq = np.clip(as_int64(short["runq_ns"], 0), 0, dur)
    preempted = _sched_codes(short["state"])[1]
    runq = np.where(preempted, dur, runq)
    flushes = (
        pd.DataFrame({"tid": as_int64(short["tid"]), "flush_ns": as_int64(short["ts_ns"]), "blk": dur - runq, "rq": runq})
        .groupby(["tid", "flush_ns"], as_index=False)[["blk", "rq"]].sum()
    )
    return {
        int(thread): (f["flush_ns"].to_numpy(np.int64), f["blk"].to_numpy(np.float64), f["rq"].to_numpy(np.float64))
        for thread, f in flushes.groupby("tid", sort=False)
    }


def _carve_short(flushes, threads: list[int], tid: np.ndarray, gap_start: np.ndarray, gap_end: np.ndarray):
    """ns of each running gap that were short waits (blocked, runnable); `threads`: the
    distinct values of `tid`.

    A flush reports the short waits since the previous flush of that thread; they are
    spread over the running time inside that period in proportion, never more than it.
    `tid` is sorted, so each thread's gaps are one contiguous range."""
    zeros = np.zeros(len(tid), np.float64)
    out_blk, out_rq = zeros, zeros.copy()
    if not flushes or not len(tid):
        return out_blk.astype(np.int64), out_rq.astype(np.int64)
    for thread in threads:  # a loop over threads, not events
        if thread not in flushes:
            continue
        period_end, blk, rq = flushes[thread]
        lo, hi = np.searchsorted(tid, thread, side="left"), np.searchsorted(tid, thread, side="right")
        period_start = np.concatenate([[np.iinfo(np.int64).min], period_end[:-1]])
        gi, pi, s, e = intersect(gap_start[lo:hi], gap_end[lo:hi], period_start, period_end)
        overlap = (e - s).astype(np.float64)
        running = np.bincount(pi, weights=overlap, minlength=len(period_end)).astype(np.float64)
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


def clipped_lengths(start: np.ndarray, end: np.ndarray, span: Span) -> np.ndarray:
    """Each interval's ns inside `span` (0 outside it)."""
    return np.maximum(np.minimum(end, span.end_ns) - np.maximum(start, span.start_ns), 0)


TOTAL_COLUMNS = ("tid", "state", "ns")


def state_totals(states: pd.DataFrame, span: Span | None = None) -> pd.DataFrame:
    """ns per (tid, state) inside `span` (default: everything), states with time only;
    long form, sorted by tid then state.  `states`: state intervals or slots."""
    slots = as_slots(states)
    tids, rank = dense_rank(slots["tid"].to_numpy())
    state = codes(slots["state"])
    edges = [slots[name].to_numpy() for name in SLOT_EDGES]
    n_states = len(STATES)

    def chunk(rows: slice) -> np.ndarray:
        sums = np.zeros((len(tids), n_states))
        whole = span is None or (edges[0][rows].min() >= span.start_ns and edges[-1][rows].max() <= span.end_ns)
        for part in range(_PARTS):
            start, end = edges[part][rows], edges[part + 1][rows]
            ns = end - start if whole else clipped_lengths(start, end, span)
            if part == BLOCKED_PART:
                key = rank[rows].astype(np.int64) * n_states + state[rows]
                sums += np.bincount(key, weights=ns, minlength=sums.size).reshape(sums.shape)
            else:
                sums[:, PART_CODES[part]] += np.bincount(rank[rows], weights=ns, minlength=len(tids))
        return sums

    # A chunk at a time, side by side; the ns are integers, so the float sums are exact
    # in any order.
    sums = np.rint(sum(run_parallel([partial(chunk, rows) for rows in row_chunks(len(slots))]),
                       np.zeros((len(tids), n_states))).ravel()).astype(np.int64)
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
