"""Vectorised interval arithmetic the analyzers share.

Intervals are half-open ``[start, end)`` in CLOCK_MONOTONIC nanoseconds, held as numpy
int64 arrays.  Nothing here loops over events in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.errors import UsageError

NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class Span:
    """A closed stretch of the trace clock: the whole trace, or the analysed window."""

    start_ns: int
    end_ns: int

    @property
    def ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @property
    def seconds(self) -> float:
        return self.ns / NS_PER_S


def trace_span(meta: Mapping[str, Any], table: pa.Table | None = None) -> Span:
    """The recording's start and end: from the clock metadata, else from the rows."""
    clock = meta.get("clock") or {}
    start = clock.get("start_mono_ns")
    end = clock.get("end_mono_ns")
    if table is not None and table.num_rows and (start is None or end is None):
        ts = table["ts_ns"]
        ends = pc.add(ts, pc.fill_null(table["dur_ns"], 0))
        if start is None:
            start = pc.min(ts).as_py()
        if end is None:
            end = pc.max(ends).as_py()
    start = int(start or 0)
    end = int(end or start)
    return Span(start, max(start, end))


def parse_window(text: str | None) -> tuple[float | None, float | None] | None:
    """"START:END" in seconds from the trace start; either side may be empty."""
    if text is None or text == "":
        return None
    head, sep, tail = str(text).partition(":")
    if not sep:
        raise UsageError(f"bad window {text!r}: expected START:END in seconds, e.g. 5:20")
    try:
        start = float(head) if head.strip() else None
        end = float(tail) if tail.strip() else None
    except ValueError:
        raise UsageError(f"bad window {text!r}: START and END must be numbers of seconds") from None
    return (start, end)


def resolve_window(span: Span, window: tuple[float | None, float | None] | None) -> Span:
    """The analysed part of the trace; a window that selects nothing is a UsageError."""
    if window is None:
        return span
    if isinstance(window, str):
        window = parse_window(window)
        if window is None:
            return span
    try:
        start_s, end_s = window
    except (TypeError, ValueError):
        raise UsageError(f"bad window {window!r}: expected (start_s, end_s)") from None
    start_s = 0.0 if start_s is None else start_s
    end_s = span.seconds if end_s is None else end_s
    try:
        start_s, end_s = float(start_s), float(end_s)
    except (TypeError, ValueError):
        raise UsageError(f"bad window {window!r}: start and end must be numbers") from None
    if not (math.isfinite(start_s) and math.isfinite(end_s)):
        raise UsageError(f"bad window {start_s}:{end_s}: start and end must be finite")
    if start_s < 0:
        raise UsageError(f"bad window {start_s:g}:{end_s:g}: start is before the trace start (0)")
    if end_s <= start_s:
        raise UsageError(f"bad window {start_s:g}:{end_s:g}: end must be after start")
    if start_s >= span.seconds:
        raise UsageError(
            f"bad window {start_s:g}:{end_s:g}: the trace lasts only {span.seconds:.3f} s"
        )
    lo = span.start_ns + int(round(start_s * NS_PER_S))
    hi = min(span.end_ns, span.start_ns + int(round(end_s * NS_PER_S)))
    return Span(lo, hi)


def as_int64(values: Any, fill: int = -1) -> np.ndarray:
    """A column (numpy or pandas nullable) as int64 with nulls replaced by `fill`."""
    if isinstance(values, (pd.Series, pd.api.extensions.ExtensionArray)):
        values = pd.Series(values)
        if values.dtype.kind not in "iu" or values.hasnans:
            return values.fillna(fill).to_numpy(dtype=np.int64)
        return values.to_numpy(dtype=np.int64)
    return np.asarray(values, dtype=np.int64)


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals as sorted, disjoint intervals (empty ones dropped)."""
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    keep = end > start
    start, end = start[keep], end[keep]
    if not len(start):
        return start, end
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    # A new run begins where an interval starts after everything before it has ended.
    new_run = np.ones(len(start), dtype=bool)
    new_run[1:] = start[1:] > reach[:-1]
    run_id = np.cumsum(new_run) - 1
    out_start = start[new_run]
    out_end = np.zeros(len(out_start), dtype=np.int64)
    np.maximum.at(out_end, run_id, end)
    return out_start, out_end


def intersect(
    a_start: np.ndarray, a_end: np.ndarray, b_start: np.ndarray, b_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pieces where intervals `a` (any order) meet intervals `b` (sorted, disjoint).

    Returns (a_index, b_index, start, end) of every non-empty piece."""
    a_start = np.asarray(a_start, dtype=np.int64)
    a_end = np.asarray(a_end, dtype=np.int64)
    first = np.searchsorted(b_end, a_start, side="right")  # first b ending after a starts
    last = np.searchsorted(b_start, a_end, side="left")  # b's starting before a ends
    counts = np.maximum(last - first, 0)
    a_index = np.repeat(np.arange(len(a_start)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    b_index = np.repeat(first, counts) + offsets
    start = np.maximum(a_start[a_index], b_start[b_index])
    end = np.minimum(a_end[a_index], b_end[b_index])
    keep = end > start
    return a_index[keep], b_index[keep], start[keep], end[keep]


class ClassTime:
    """Time per class inside any [a, b), for one thread whose intervals tile its life.

    `start`/`end` sorted and disjoint, `code` in range(n_classes).  Built once per thread,
    queried with arrays of windows."""

    def __init__(self, start: np.ndarray, end: np.ndarray, code: np.ndarray, n_classes: int):
        self.start = np.asarray(start, dtype=np.int64)
        self.length = np.asarray(end, dtype=np.int64) - self.start
        self.code = np.asarray(code, dtype=np.int64)
        self.n_classes = n_classes
        onehot = np.zeros((len(self.start) + 1, n_classes), dtype=np.int64)
        onehot[np.arange(1, len(self.start) + 1), self.code] = self.length
        self.cum = np.cumsum(onehot, axis=0)  # row i: time per class before interval i

    def upto(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.int64)
        i = np.searchsorted(self.start, x, side="right") - 1
        j = np.maximum(i, 0)
        out = self.cum[np.where(i >= 0, j, 0)].copy()
        if len(self.start):
            partial = np.where(i >= 0, np.clip(x - self.start[j], 0, self.length[j]), 0)
            out[np.arange(len(x)), self.code[j]] += partial
        return out

    def between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(len(a), n_classes) ns per class inside each [a, b)."""
        return self.upto(b) - self.upto(a)


def thread_ranges(tid: np.ndarray) -> dict[int, tuple[int, int]]:
    """{tid: (first, last + 1)} positions of each thread's run in an array sorted by tid."""
    if not len(tid):
        return {}
    starts = np.concatenate([[0], np.flatnonzero(tid[1:] != tid[:-1]) + 1])
    ends = np.concatenate([starts[1:], [len(tid)]])
    return {int(t): (int(a), int(b)) for t, a, b in zip(tid[starts], starts, ends)}


def dense_rank(tid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct tids, each row's index among them) without sorting the rows:
    tids are small non-negative integers, so a table lookup does it (np.unique otherwise)."""
    tid = np.asarray(tid)
    if not len(tid) or tid.min() < 0 or tid.max() > 1 << 24:
        return np.unique(tid, return_inverse=True)
    present = np.flatnonzero(np.bincount(tid))
    rank_type = np.uint16 if len(present) <= 1 << 16 else np.uint32
    lut = np.zeros(int(present[-1]) + 1, dtype=rank_type)
    lut[present] = np.arange(len(present), dtype=rank_type)
    return present, lut[tid]


def sort_by_thread(tid: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The order that sorts rows by (tid, start), ties kept in input order.

    Recorded rows arrive nearly sorted by time, where a stable sort is fast; the threads
    are then ordered by a (radix) sort of their small dense rank."""
    by_time = np.argsort(start, kind="stable")
    return by_time[np.argsort(dense_rank(np.asarray(tid)[by_time])[1], kind="stable")]


def best_overlap(left: pd.DataFrame, right: pd.DataFrame, *, by: str = "tid") -> np.ndarray:
    """For each `left` interval, the position in `right` of the same-`by` interval that
    overlaps it most (-1: none).  Both frames have start_ns/end_ns.

    Per thread, two candidates: of the `right` intervals starting at or before the left
    start, the one reaching furthest; and the first one starting inside the left interval."""
    out = np.full(len(left), -1, dtype=np.int64)
    if not len(left) or not len(right):
        return out
    l_tid, l_start, l_end = as_int64(left[by]), as_int64(left["start_ns"]), as_int64(left["end_ns"])
    l_order = sort_by_thread(l_tid, l_start)
    r_tid, r_start, r_end = as_int64(right[by]), as_int64(right["start_ns"]), as_int64(right["end_ns"])
    r_order = sort_by_thread(r_tid, r_start)
    r_ranges = thread_ranges(r_tid[r_order])
    for tid, (a, b) in thread_ranges(l_tid[l_order]).items():  # a loop over threads
        if tid not in r_ranges:
            continue
        c, d = r_ranges[tid]
        rows = r_order[c:d]
        rs, re = r_start[rows], r_end[rows]
        lpos = l_order[a:b]
        ls, le = l_start[lpos], l_end[lpos]
        reach = np.maximum.accumulate(re)
        furthest = np.maximum.accumulate(np.where(re >= reach, np.arange(len(re)), 0))
        i = np.searchsorted(rs, ls, side="right") - 1
        k = furthest[np.maximum(i, 0)]
        before = np.where(i >= 0, np.minimum(le, re[k]) - ls, 0)
        j = np.minimum(i + 1, len(rs) - 1)
        inside = np.where(i + 1 < len(rs), np.minimum(le, re[j]) - rs[j], 0)
        best = np.where(inside > before, j, k)
        overlap = np.maximum(before, inside)
        out[lpos] = np.where(overlap > 0, rows[best], -1)
    return out
