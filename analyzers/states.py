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

from trainbpf.analyzers.categories import STATE_DTYPE, STATES
from trainbpf.analyzers.intervals import NS_PER_S, Span, as_int64, intersect

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
        }
    )


def _blocked_code(sched_state: np.ndarray) -> np.ndarray:
    """What the scheduler's state letter alone says about a blocked interval."""
    letter = pd.Series(sched_state, dtype=object).fillna("").astype(str).str[:1].to_numpy(dtype=object)
    code = np.full(len(letter), _CODE["other"], dtype=np.int8)
    code[(letter == "S") | (letter == "I")] = _CODE["sleep"]
    code[letter == "D"] = _CODE["uninterruptible"]
    return code


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

    tid = as_int64(offcpu["tid"])
    known = np.isin(tid, t_tid)
    tid = tid[known]
    ts = as_int64(offcpu["ts_ns"])[known]
    dur = np.maximum(as_int64(offcpu["dur_ns"], 0)[known], 0)
    runq = np.clip(as_int64(offcpu["runq_ns"], 0)[known], 0, dur)
    sched = offcpu["state"].to_numpy(dtype=object)[known]
    blocked_code = _blocked_code(sched)
    preempted = pd.Series(sched, dtype=object).fillna("").astype(str).str[:1].to_numpy(dtype=object) == "R"
    runq = np.where(preempted, dur, runq)
    waker = as_int64(offcpu["peer_tid"])[known]
    kstack = as_int64(offcpu["kstack_id"])[known]
    ustack = as_int64(offcpu["ustack_id"])[known]

    pos = np.searchsorted(t_tid, tid)
    first, last = t_first[pos], t_last[pos]
    start = np.clip(ts, first, last)
    end = np.clip(ts + dur, first, last)
    wake = np.clip(ts + dur - runq, start, end)

    # One virtual row per thread at its end carries the tail running gap.
    n_rows = len(tid)
    tid = np.concatenate([tid, t_tid])
    start = np.concatenate([start, t_last])
    wake = np.concatenate([wake, t_last])
    end = np.concatenate([end, t_last])
    first = np.concatenate([first, t_first])
    virtual = np.concatenate([np.zeros(n_rows, bool), np.ones(len(t_tid), bool)])
    order = np.lexsort((virtual, start, tid))
    tid, start, wake, end, first = tid[order], start[order], wake[order], end[order], first[order]
    src = np.where(virtual[order], -1, order)  # offcpu row behind each slot

    # Overlapping rows (inconsistent input) lose their overlap to the earlier row.
    reach = pd.Series(end).groupby(tid).cummax().to_numpy()
    prev_end = np.empty_like(reach)
    prev_end[1:] = reach[:-1]
    new_thread = np.ones(len(tid), bool)
    new_thread[1:] = tid[1:] != tid[:-1]
    prev_end[new_thread] = first[new_thread]
    start = np.maximum(start, prev_end)
    wake = np.clip(wake, start, np.maximum(end, start))
    end = np.maximum(end, start)
    gap_start = prev_end
    gap_end = start

    short_blk, short_rq = _carve_short(offcpu_short, tid, gap_start, gap_end)
    run_end = gap_end - short_blk - short_rq

    bounds = np.stack(
        [gap_start, run_end, run_end + short_blk, gap_end, wake, end], axis=1
    )  # (n, 6): edges of the 5 parts
    p_start = bounds[:, :-1].ravel()
    p_end = bounds[:, 1:].ravel()
    keep = p_end > p_start
    slot = np.repeat(np.arange(len(tid)), _PARTS)[keep]
    part = np.tile(np.arange(_PARTS), len(tid))[keep]
    row = src[slot]
    has_row = row >= 0
    safe_row = np.where(has_row, row, 0)

    def from_row(values: np.ndarray, parts: tuple[int, ...]) -> np.ndarray:
        picked = values[safe_row] if len(values) else np.zeros(len(row), np.int64)
        return np.where(has_row & np.isin(part, parts), picked, -1)

    code = np.array(
        [_CODE["running"], _CODE["short_wait"], _CODE["runnable"], 0, _CODE["runnable"]], dtype=np.int8
    )[part]
    is_blocked = part == 3
    code[is_blocked] = blocked_code[safe_row[is_blocked]] if n_rows else code[is_blocked]
    # The waker ended the blocked part; stacks were taken at switch-out.
    return _frame(
        tid[slot], p_start[keep], p_end[keep], code,
        from_row(waker, (3, 4)), from_row(kstack, (3,)), from_row(ustack, (3,)),
    )


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
    preempted = short["state"].fillna("").astype(str).str[:1].to_numpy(dtype=object) == "R"
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


def clip_states(states: pd.DataFrame, span: Span) -> pd.DataFrame:
    """The state intervals cut to the analysed window."""
    start = np.maximum(states["start_ns"].to_numpy(), span.start_ns)
    end = np.minimum(states["end_ns"].to_numpy(), span.end_ns)
    keep = end > start
    out = states[keep].copy()
    out["start_ns"] = start[keep]
    out["end_ns"] = end[keep]
    return out.reset_index(drop=True)


TOTAL_COLUMNS = ("tid", "state", "ns")


def state_totals(states: pd.DataFrame) -> pd.DataFrame:
    """ns per (tid, state), every state that occurs; long form."""
    df = pd.DataFrame(
        {"tid": states["tid"].to_numpy(np.int64), "state": states["state"],
         "ns": (states["end_ns"] - states["start_ns"]).to_numpy(np.int64)}
    )
    out = df.groupby(["tid", "state"], observed=True, as_index=False)["ns"].sum()
    out["ns"] = out["ns"].astype(np.int64)
    out["tid"] = out["tid"].astype(np.int64)
    return out[list(TOTAL_COLUMNS)]


def state_seconds(totals: pd.DataFrame) -> dict[int, dict[str, float]]:
    """{tid: {state: seconds}} in the fixed state order, states with time only."""
    out: dict[int, dict[str, float]] = {}
    for tid, group in totals.groupby("tid", sort=True):
        ns = dict(zip(group["state"].astype(str), group["ns"]))
        out[int(tid)] = {s: ns[s] / NS_PER_S for s in STATES if ns.get(s, 0) > 0}
    return out
