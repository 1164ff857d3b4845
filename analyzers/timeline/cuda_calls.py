"""The host-side GPU timeline from the CUDA probe's rows (docs/trace-format.md, "CUDA
calls"): when each thread waited for the GPU, when it launched work, the launch gaps in
between, and the training steps that the wait/launch rhythm shows.

- `gpu_waits(cuda_call)`: the intervals a thread was blocked on the GPU: synchronisations
  (`state == "wait"`), synchronous copies (cudaMemcpy, cuMemcpy, cuMemcpyHtoD,
  cuMemcpyDtoH) and synchronous frees (cudaFree, cuMemFree, cudaFreeHost, cuMemFreeHost:
  they wait for the device to go idle first; cudaFreeAsync/cuMemFreeAsync do not).  A runtime call and the driver call it makes (`op == 1`) overlap; only
  the outermost counts, so nothing is counted twice.
- `launch_bursts(cuda_launch)`: the launches each thread issued (`nested == 0` rows) as
  bursts.  A row's [ts_ns, ts_ns + dur_ns] runs from its 10 ms bucket's first launch
  (exact) to the bucket's end.
- `launch_gaps(waits, bursts)`: from the end of a wait to the first launch after it.
- `steps(waits, bursts)`: one step per wait end followed by launches, to the next such
  wait end (the last: to the last wait end after its launches); `step_summary` gives
  steps/s, step time p50/p99, host-bound share and the worst steps.
- `split_at_waits(intervals, waits)` / `gpu_bound_ns`: a thread's state intervals cut at
  its waits, each piece marked inside or outside one.
- `in_gaps_ns(pieces, gaps)`: the part of each starved piece's time inside launch gaps
  (the seconds of launch gap a finding explains); `cuda_threads` and `timeline`: per
  thread launches, waits and gap time in the window, for the reports.

How the starvation estimator (analyzers/timeline/starvation.py) uses the last: with CUDA rows in the
trace, call `split_at_waits(trainer_states, gpu_waits(cuda_call, tids={trainer}))` and
take the pieces instead of the trainer's state intervals.  Pieces with `in_wait` are
GPU-bound: the trainer waited for the GPU, which was busy; they are excluded from
starvation (neither named nor unwoken) and reported as GPU-bound seconds
(`gpu_bound_ns`).  Pieces outside any wait are stalls as before, with one change: an
unwoken sleep there is no longer presumed a GPU wait (the CUDA rows show none), so it
counts as a named stall of its own cause (a timer sleep in the data path) instead of
going to `unwoken_ns`.  Without CUDA rows nothing changes.  The trainer's stalls inside
a launch gap are the starved time the gap explains, attributed to the existing causes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import NS_PER_S, Span, as_int64, intersect, merge_intervals

# Copies that block the calling thread until the GPU has done them (the Async ones and
# device-to-device copies return at once).
SYNC_COPIES = frozenset({"cudaMemcpy", "cuMemcpy", "cuMemcpyHtoD", "cuMemcpyDtoH"})
# Frees that synchronise the device before they release the memory (the stream-ordered
# cudaFreeAsync/cuMemFreeAsync return at once): the thread waits for all queued work.
SYNC_FREES = frozenset({"cudaFree", "cuMemFree", "cudaFreeHost", "cuMemFreeHost"})
# One row per wait, disjoint per thread: `name` the outermost call.
WAIT_COLUMNS = ("tid", "pid", "start_ns", "end_ns", "name")
# One row per burst of launches of one thread: [start_ns, end_ns] the span of its launches.
BURST_COLUMNS = ("tid", "pid", "start_ns", "end_ns", "launches")
# One row per wait followed by a launch before the thread's next wait: [start_ns, end_ns)
# from the wait's end to that launch; `wait` the wait's row position in `waits`.
GAP_COLUMNS = ("tid", "start_ns", "end_ns", "gap_ns", "wait")
# One row per step: [start_ns, end_ns) from a wait end followed by launches to the next;
# host_ns the launch gap that opens it, gpu_wait_ns the waits inside, launches issued.
STEP_COLUMNS = ("tid", "start_ns", "end_ns", "step_ns", "host_ns", "gpu_wait_ns", "launches", "host_share")
# One row per thread with CUDA rows reaching into the window: launches issued (the
# buckets starting in it), waits overlapping it, their ns and the launch-gap ns inside it.
CUDA_THREAD_COLUMNS = ("tid", "pid", "launches", "waits", "wait_ns", "gap_ns")
WORST_STEPS = 5


def _col(frame: pd.DataFrame, name: str, fill: int = -1) -> np.ndarray:
    return as_int64(frame[name], fill) if name in frame else np.full(len(frame), fill, np.int64)


def _text(frame: pd.DataFrame, name: str) -> np.ndarray:
    return frame[name].astype(object).to_numpy() if name in frame else np.full(len(frame), None, object)


def _select_tids(frame: pd.DataFrame, tids: Iterable[int] | None) -> np.ndarray:
    if tids is None:
        return np.ones(len(frame), bool)
    return np.isin(_col(frame, "tid"), np.fromiter(tids, np.int64))


def _reach_before(tid: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Rows sorted by (tid, start): the furthest end of the thread's earlier rows
    (int64 min for a thread's first row)."""
    reach = pd.Series(end).groupby(tid).cummax().to_numpy(np.int64)
    before = np.full(len(end), np.iinfo(np.int64).min, np.int64)
    same = np.zeros(len(end), bool)
    same[1:] = tid[1:] == tid[:-1]
    before[1:] = np.where(same[1:], reach[:-1], before[1:])
    return before


def gpu_waits(cuda_call: pd.DataFrame, *, tids: Iterable[int] | None = None) -> pd.DataFrame:
    """WAIT_COLUMNS: each thread's waits for the GPU (of `tids`, all threads if None),
    sorted by thread and time.  Nested calls keep the outermost; calls that only partly
    overlap an earlier one keep the part after it."""
    state, name = _text(cuda_call, "state"), _text(cuda_call, "name")
    pick = (state == "wait") | ((state == "copy") & np.isin(name, list(SYNC_COPIES)))
    pick |= (state == "free") & np.isin(name, list(SYNC_FREES))
    pick &= _select_tids(cuda_call, tids)
    rows = np.flatnonzero(pick)
    tid, pid = _col(cuda_call, "tid")[rows], _col(cuda_call, "pid")[rows]
    start = _col(cuda_call, "ts_ns", 0)[rows]
    end = start + np.maximum(_col(cuda_call, "dur_ns", 0)[rows], 0)
    order = np.lexsort((-end, start, tid))  # per thread by start, the longest (outer) first
    tid, pid, start, end, name = tid[order], pid[order], start[order], end[order], name[rows][order]
    before = _reach_before(tid, end)
    keep = end > before  # not inside an earlier call of the thread
    start = np.maximum(start, before)
    keep &= end > start
    return pd.DataFrame({"tid": tid[keep], "pid": pid[keep], "start_ns": start[keep], "end_ns": end[keep],
                         "name": pd.Series(name[keep], dtype=object)})[list(WAIT_COLUMNS)]


def launch_bursts(cuda_launch: pd.DataFrame, *, tids: Iterable[int] | None = None, join_ns: int = 0) -> pd.DataFrame:
    """BURST_COLUMNS: the launches each thread issued (`nested == 0` rows of
    Trace.view("cuda_launch"), runtime and direct
    driver launches alike), rows whose spans overlap or lie within `join_ns` of each
    other merged into one burst; sorted by thread and time."""
    pick = (_col(cuda_launch, "nested", 0) == 0) & (_col(cuda_launch, "launches", 0) > 0) & _select_tids(cuda_launch, tids)
    rows = np.flatnonzero(pick)
    tid, pid = _col(cuda_launch, "tid")[rows], _col(cuda_launch, "pid")[rows]
    start = _col(cuda_launch, "ts_ns", 0)[rows]
    end = start + np.maximum(_col(cuda_launch, "dur_ns", 0)[rows], 0)
    count = _col(cuda_launch, "launches", 0)[rows]
    order = np.lexsort((end, start, tid))
    tid, pid, start, end, count = tid[order], pid[order], start[order], end[order], count[order]
    before = _reach_before(tid, end)
    new = start > before + join_ns  # also true for each thread's first row
    run = np.cumsum(new) - 1
    n = int(new.sum())
    out_end = np.full(n, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(out_end, run, end)
    return pd.DataFrame({"tid": tid[new], "pid": pid[new], "start_ns": start[new], "end_ns": out_end,
                         "launches": np.bincount(run, weights=count, minlength=n).astype(np.int64)})[list(BURST_COLUMNS)]


def launch_gaps(waits: pd.DataFrame, bursts: pd.DataFrame) -> pd.DataFrame:
    """GAP_COLUMNS: per wait, the time from its end to the thread's first launch after
    it, for waits whose next launch comes before the thread's next wait (a wait followed
    by another wait opens no gap: the later one does).  The first launch after a wait is
    the start of the first burst reaching past the wait's end, or the wait's end itself
    when that burst began before it (a bucket that straddles the wait)."""
    parts = []
    w_tid = _col(waits, "tid")
    b_tid = _col(bursts, "tid")
    for t in np.unique(w_tid):
        w_rows = np.flatnonzero(w_tid == t)
        w_rows = w_rows[np.argsort(waits["start_ns"].to_numpy(np.int64)[w_rows], kind="stable")]
        w_start = waits["start_ns"].to_numpy(np.int64)[w_rows]
        w_end = waits["end_ns"].to_numpy(np.int64)[w_rows]
        b = b_tid == t
        b_start, b_end = bursts["start_ns"].to_numpy(np.int64)[b], bursts["end_ns"].to_numpy(np.int64)[b]
        reach = np.maximum(b_end, b_start + 1)  # a burst of one launch still has its instant
        at = np.searchsorted(reach, w_end, side="right")  # first burst reaching past the wait's end
        has = at < len(b_start)
        launch = np.maximum(np.append(b_start, 0)[at], w_end)
        next_wait = np.append(w_start[1:], np.iinfo(np.int64).max)
        keep = has & (launch < next_wait)
        parts.append(pd.DataFrame({"tid": t, "start_ns": w_end[keep], "end_ns": launch[keep],
                                   "gap_ns": launch[keep] - w_end[keep], "wait": w_rows[keep].astype(np.int64)}))
    if not parts:
        return pd.DataFrame({c: np.zeros(0, np.int64) for c in GAP_COLUMNS})
    return pd.concat(parts, ignore_index=True).astype(np.int64)[list(GAP_COLUMNS)]


def _sum_between(keys: np.ndarray, values: np.ndarray, lo: np.ndarray, hi: np.ndarray, side: str) -> np.ndarray:
    """Sum of `values` whose (sorted) `keys` fall between each lo and hi (searchsorted `side`)."""
    cum = np.concatenate([[0], np.cumsum(values)])
    return cum[np.searchsorted(keys, hi, side=side)] - cum[np.searchsorted(keys, lo, side=side)]


def steps(waits: pd.DataFrame, bursts: pd.DataFrame, *, window: Span | None = None) -> pd.DataFrame:
    """STEP_COLUMNS: per thread, one step from each wait end that launches follow (a
    launch gap's start) to the next, the last to the thread's last wait end after its
    launches; steps wholly inside `window` (all if None).
    gpu_wait_ns sums the thread's waits inside the step, launches the bursts starting
    in it (to the bucket while launches are bucketed), host_share is host_ns / step_ns."""
    gaps = launch_gaps(waits, bursts)
    parts = []
    for t in np.unique(gaps["tid"].to_numpy(np.int64)):
        g = gaps[gaps["tid"].to_numpy(np.int64) == t].sort_values("start_ns", kind="stable")
        mine = _col(waits, "tid") == t
        w_end = waits["end_ns"].to_numpy(np.int64)[mine]
        start, host = g["start_ns"].to_numpy(np.int64), g["gap_ns"].to_numpy(np.int64)
        # each step ends where the next begins; the last at the thread's last wait end,
        # if a wait followed its launches (else it is still open)
        end = np.append(start[1:], w_end.max())
        if end[-1] <= g["end_ns"].to_numpy(np.int64)[-1]:
            start, end, host = start[:-1], end[:-1], host[:-1]
        order = np.argsort(w_end, kind="stable")
        w_len = (w_end - waits["start_ns"].to_numpy(np.int64)[mine])[order]
        waited = _sum_between(w_end[order], w_len, start, end, "right")  # waits ending in (start, end]
        b = _col(bursts, "tid") == t
        launches = _sum_between(bursts["start_ns"].to_numpy(np.int64)[b], bursts["launches"].to_numpy(np.int64)[b],
                                start, end, "left")  # bursts starting in [start, end)
        parts.append(pd.DataFrame({"tid": t, "start_ns": start, "end_ns": end, "step_ns": end - start,
                                   "host_ns": host, "gpu_wait_ns": waited, "launches": launches}))
    if not parts:
        parts.append(pd.DataFrame({c: np.zeros(0, np.int64) for c in STEP_COLUMNS[:-1]}))
    out = pd.concat(parts, ignore_index=True).astype(np.int64)
    if window is not None:
        out = out[(out["start_ns"] >= window.start_ns) & (out["end_ns"] <= window.end_ns)].reset_index(drop=True)
    out["host_share"] = out["host_ns"] / out["step_ns"].where(out["step_ns"] > 0).astype(np.float64)
    out["host_share"] = out["host_share"].fillna(0.0)
    return out[list(STEP_COLUMNS)]


def step_summary(step_rows: pd.DataFrame, *, worst: int = WORST_STEPS) -> dict[str, Any]:
    """Steps, steps/s (over the stretch they cover), step time p50/p99 and mean in
    seconds, the host-bound share (launch-gap time over step time) and the `worst`
    longest steps.  Pass one thread's steps for that thread's rhythm."""
    n = len(step_rows)
    if not n:
        return {"steps": 0, "steps_per_s": 0.0, "step_p50_s": None, "step_p99_s": None, "step_mean_s": None,
                "host_bound_share": None, "gpu_wait_share": None, "worst": []}
    step_ns = step_rows["step_ns"].to_numpy(np.float64)
    covered = float(step_rows["end_ns"].max() - step_rows["start_ns"].min())
    total = float(step_ns.sum())
    longest = step_rows.sort_values("step_ns", ascending=False, kind="stable").head(worst)
    return {
        "steps": n,
        "steps_per_s": n / (covered / NS_PER_S) if covered > 0 else 0.0,
        "step_p50_s": float(np.percentile(step_ns, 50)) / NS_PER_S,
        "step_p99_s": float(np.percentile(step_ns, 99)) / NS_PER_S,
        "step_mean_s": total / n / NS_PER_S,
        "host_bound_share": float(step_rows["host_ns"].sum()) / total if total > 0 else 0.0,
        "gpu_wait_share": float(step_rows["gpu_wait_ns"].sum()) / total if total > 0 else 0.0,
        "worst": [{"tid": int(r.tid), "start_ns": int(r.start_ns), "step_s": r.step_ns / NS_PER_S,
                   "host_s": r.host_ns / NS_PER_S, "gpu_wait_s": r.gpu_wait_ns / NS_PER_S,
                   "host_share": float(r.host_share)} for r in longest.itertuples()],
    }


def split_at_waits(intervals: pd.DataFrame, waits: pd.DataFrame) -> pd.DataFrame:
    """`intervals` (start_ns, end_ns and any other columns; with a `tid` column each row
    meets only its thread's waits, without one every wait) cut at the waits' edges: one
    row per piece, the other columns copied, plus `interval` (the row's position in
    `intervals`) and `in_wait`.  The pieces of a row tile it; sorted by row and time."""
    a_start = intervals["start_ns"].to_numpy(np.int64)
    a_end = intervals["end_ns"].to_numpy(np.int64)
    w_tid = _col(waits, "tid")
    by_tid = "tid" in intervals
    groups = np.unique(_col(intervals, "tid")) if by_tid else np.array([0])
    ia_all, ps_all, pe_all = [], [], []
    for t in groups:
        rows = np.flatnonzero(_col(intervals, "tid") == t) if by_tid else np.arange(len(intervals))
        w = (w_tid == t) if by_tid else np.ones(len(waits), bool)
        ws, we = merge_intervals(waits["start_ns"].to_numpy(np.int64)[w], waits["end_ns"].to_numpy(np.int64)[w])
        ia, _, ps, pe = intersect(a_start[rows], a_end[rows], ws, we)
        ia_all.append(rows[ia])
        ps_all.append(ps)
        pe_all.append(pe)
    ia, ps, pe = (np.concatenate(x).astype(np.int64) if x else np.zeros(0, np.int64) for x in (ia_all, ps_all, pe_all))
    order = np.lexsort((ps, ia))
    ia, ps, pe = ia[order], ps[order], pe[order]
    n, m = len(intervals), len(ia)
    # Outside pieces: from a row's start or an inside piece's end to the next inside
    # piece's start or the row's end.
    s_row, s_key = np.concatenate([np.arange(n), ia]), np.concatenate([np.full(n, -1), np.arange(m)])
    e_row, e_key = np.concatenate([ia, np.arange(n)]), np.concatenate([np.arange(m), np.full(n, m)])
    s_order, e_order = np.lexsort((s_key, s_row)), np.lexsort((e_key, e_row))
    o_row = s_row[s_order]
    o_start = np.concatenate([a_start, pe])[s_order]
    o_end = np.concatenate([ps, a_end])[e_order]
    out_ok = o_end > o_start
    row = np.concatenate([o_row[out_ok], ia])
    start = np.concatenate([o_start[out_ok], ps])
    end = np.concatenate([o_end[out_ok], pe])
    inside = np.concatenate([np.zeros(int(out_ok.sum()), bool), np.ones(m, bool)])
    order = np.lexsort((start, row))
    row, start, end, inside = row[order], start[order], end[order], inside[order]
    out = intervals.iloc[row].reset_index(drop=True)
    out["start_ns"] = start
    out["end_ns"] = end
    out["interval"] = row
    out["in_wait"] = inside
    return out


def gpu_bound_ns(intervals: pd.DataFrame, waits: pd.DataFrame) -> np.ndarray:
    """Per row of `intervals`, the ns of it inside the waits (as split_at_waits)."""
    pieces = split_at_waits(intervals, waits)
    inside = pieces["in_wait"].to_numpy(bool)
    ns = (pieces["end_ns"] - pieces["start_ns"]).to_numpy(np.int64)[inside]
    return np.bincount(pieces["interval"].to_numpy(np.int64)[inside], weights=ns,
                       minlength=len(intervals)).astype(np.int64)


def in_gaps_ns(pieces: pd.DataFrame, gaps: pd.DataFrame) -> np.ndarray:
    """Per row of `pieces` (start_ns, end_ns, ns: one thread's starved pieces, ns at most
    the piece's length), the part of its ns inside the launch `gaps` (GAP_COLUMNS of the
    same thread), in proportion to the piece's length inside them; float64."""
    start, end = pieces["start_ns"].to_numpy(np.int64), pieces["end_ns"].to_numpy(np.int64)
    gs, ge = merge_intervals(gaps["start_ns"].to_numpy(np.int64), gaps["end_ns"].to_numpy(np.int64))
    ia, _, s, e = intersect(start, end, gs, ge)
    inside = np.bincount(ia, weights=(e - s).astype(np.float64), minlength=len(pieces))
    return pieces["ns"].to_numpy(np.float64) * inside / np.maximum(end - start, 1)


def _clipped_ns(start: np.ndarray, end: np.ndarray, window: Span | None) -> np.ndarray:
    if window is None:
        return np.maximum(end - start, 0)
    return np.maximum(np.minimum(end, window.end_ns) - np.maximum(start, window.start_ns), 0)


def cuda_threads(cuda_call: pd.DataFrame, cuda_launch: pd.DataFrame, waits: pd.DataFrame, gaps: pd.DataFrame,
                 *, window: Span | None = None) -> pd.DataFrame:
    """CUDA_THREAD_COLUMNS, sorted by tid: every thread with a CUDA row (any call, any
    launch) reaching into `window` (all if None).  launches: its issued launches
    (`nested == 0`) in buckets starting inside the window; waits: its `waits` (WAIT_COLUMNS)
    overlapping the window, wait_ns their time inside it; gap_ns: its `gaps` (GAP_COLUMNS)
    inside it."""
    lo = np.iinfo(np.int64).min if window is None else window.start_ns
    hi = np.iinfo(np.int64).max if window is None else window.end_ns

    def rows(frame: pd.DataFrame) -> pd.DataFrame:
        ts = _col(frame, "ts_ns", 0)
        end = ts + np.maximum(_col(frame, "dur_ns", 0), 0)
        touch = (ts < hi) & (end >= lo) & (_col(frame, "tid") >= 0)
        return pd.DataFrame({"tid": _col(frame, "tid")[touch], "pid": _col(frame, "pid")[touch]})

    seen = pd.concat([rows(cuda_call), rows(cuda_launch)], ignore_index=True)
    out = seen.groupby("tid", sort=True)["pid"].max().reset_index() if len(seen) else \
        pd.DataFrame({"tid": np.zeros(0, np.int64), "pid": np.zeros(0, np.int64)})
    tids = out["tid"].to_numpy(np.int64)

    def per_thread(tid: np.ndarray, values: np.ndarray) -> np.ndarray:
        known = np.isin(tid, tids)
        at = np.searchsorted(tids, tid[known])
        return np.bincount(at, weights=values[known].astype(np.float64), minlength=len(tids)).astype(np.int64)

    ts = _col(cuda_launch, "ts_ns", 0)
    issued = (_col(cuda_launch, "nested", 0) == 0) & (ts >= lo) & (ts < hi)
    w_tid, w_start, w_end = (waits[c].to_numpy(np.int64) for c in ("tid", "start_ns", "end_ns"))
    w_ns = _clipped_ns(w_start, w_end, window)
    g_tid = gaps["tid"].to_numpy(np.int64)
    g_ns = _clipped_ns(gaps["start_ns"].to_numpy(np.int64), gaps["end_ns"].to_numpy(np.int64), window)
    out["launches"] = per_thread(_col(cuda_launch, "tid")[issued], _col(cuda_launch, "launches", 0)[issued])
    out["waits"] = per_thread(w_tid, (w_ns > 0).astype(np.int64))
    out["wait_ns"] = per_thread(w_tid, w_ns)
    out["gap_ns"] = per_thread(g_tid, g_ns)
    return out.astype(np.int64)[list(CUDA_THREAD_COLUMNS)]


@dataclass
class CudaTimeline:
    """Every thread's GPU waits, launch bursts and launch gaps over the whole trace
    (WAIT_COLUMNS, BURST_COLUMNS, GAP_COLUMNS), and `threads` (CUDA_THREAD_COLUMNS) over
    the analysed window: what the reports draw and count per thread."""

    waits: pd.DataFrame
    bursts: pd.DataFrame
    gaps: pd.DataFrame
    threads: pd.DataFrame

    def of(self, tid: int | None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        """One thread's (waits, bursts, gaps) (none for None), each re-indexed from 0
        (gaps' `wait` column then indexes the thread's waits)."""
        tid = -1 if tid is None else int(tid)
        waits = self.waits[self.waits["tid"].to_numpy(np.int64) == tid].reset_index(drop=True)
        bursts = self.bursts[self.bursts["tid"].to_numpy(np.int64) == tid].reset_index(drop=True)
        return waits, bursts, launch_gaps(waits, bursts)


def timeline(cuda_call: pd.DataFrame, cuda_launch: pd.DataFrame, *, window: Span | None = None) -> CudaTimeline | None:
    """The CudaTimeline of a trace's CUDA rows; None when it holds none (CUDA not traced)."""
    if not len(cuda_call) and not len(cuda_launch):
        return None
    waits, bursts = gpu_waits(cuda_call), launch_bursts(cuda_launch)
    gaps = launch_gaps(waits, bursts)
    return CudaTimeline(waits, bursts, gaps, cuda_threads(cuda_call, cuda_launch, waits, gaps, window=window))
