"""Vectorised interval arithmetic the analyzers share.

Intervals are half-open ``[start, end)`` in CLOCK_MONOTONIC nanoseconds, held as numpy
int64 arrays.  Nothing here loops over events in Python.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.analyzers.options import Window
from trainbpf.trace.errors import UsageError

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


def trace_span(meta: Mapping[str, Any], chunks: Iterable[pa.Table] = ()) -> Span:
    """The recording's start and end: from the clock metadata, else from the rows
    (`chunks`: tables with ts_ns and dur_ns, read only when the metadata lacks either)."""
    clock = meta.get("clock") or {}
    start = clock.get("start_mono_ns")
    end = clock.get("end_mono_ns")
    if start is None or end is None:
        firsts, lasts = [], []
        for chunk in chunks:
            firsts.append(pc.min(chunk["ts_ns"]).as_py())
            lasts.append(pc.max(pc.add(chunk["ts_ns"], pc.fill_null(chunk["dur_ns"], 0))).as_py())
        if start is None:
            start = min((v for v in firsts if v is not None), default=None)
        if end is None:
            end = max((v for v in lasts if v is not None), default=None)
    start = int(start or 0)
    end = int(end or start)
    return Span(start, max(start, end))


def resolve_window(span: Span, window: Window | None) -> Span:
    """The analysed part of the trace; a window that selects nothing is a UsageError."""
    if window is None:
        return span
    start_s = 0.0 if window.start_s is None else window.start_s
    end_s = span.seconds if window.end_s is None else window.end_s
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


def pair_ids(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dense ids of the distinct (a, b) pairs, by hashing (no sort)."""
    a_code, a_values = pd.factorize(a)
    pair = pd.factorize(b)[0].astype(np.int64) * max(len(a_values), 1) + a_code
    return pd.factorize(pair)[0].astype(np.int64)


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
    if counts.max(initial=0) <= 1:  # each a meets at most one b: no repeats needed
        a_index = np.flatnonzero(counts)
        b_index = first[a_index]
    else:
        a_index = np.repeat(np.arange(len(a_start)), counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        b_index = np.repeat(first, counts) + offsets
    start = np.maximum(a_start[a_index], b_start[b_index])
    end = np.minimum(a_end[a_index], b_end[b_index])
    keep = end > start
    if keep.all():
        return a_index, b_index, start, end
    return a_index[keep], b_index[keep], start[keep], end[keep]


class ClassTime:
    """Time per class inside any [a, b), for one thread whose intervals tile its life.

    `start`/`end` sorted and disjoint, `code` in range(n_classes).  Built once per thread,
    queried with arrays of windows.  `of_parts` indexes rows of several consecutive parts
    each (state slots)."""

    def __init__(self, start: np.ndarray, end: np.ndarray, code: np.ndarray, n_classes: int):
        self._index([start, end], [np.asarray(code)], n_classes)

    @classmethod
    def of_parts(cls, edges: list[np.ndarray], codes: list[np.ndarray | int], n_classes: int) -> ClassTime:
        """Rows of len(codes) parts: part p is [edges[p], edges[p + 1]) of class codes[p]
        (an array per row, or one class for every row)."""
        index = cls.__new__(cls)
        index._index(edges, codes, n_classes)
        return index

    def _index(self, edges: list[np.ndarray], codes: list[np.ndarray | int], n_classes: int) -> None:
        self.edges = [np.asarray(e, dtype=np.int64) for e in edges]
        self.codes = codes
        self.cum = []  # per class: time before each row (and after the last)
        for k in range(n_classes):
            length = np.zeros(len(self.edges[0]) + 1, dtype=np.int64)
            for p, code in enumerate(codes):
                if np.ndim(code):
                    length[1:] += np.where(code == k, self.edges[p + 1] - self.edges[p], 0)
                elif code == k:
                    length[1:] += self.edges[p + 1] - self.edges[p]
            self.cum.append(np.cumsum(length, out=length))

    def upto(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.int64)
        i = np.searchsorted(self.edges[0], x, side="right") - 1  # the row x falls in or after
        j = np.maximum(i, 0)
        out = np.stack([cum[j] for cum in self.cum], axis=1)
        if len(self.edges[0]):
            every = np.arange(len(x))
            for p, code in enumerate(self.codes):
                start, end = self.edges[p][j], self.edges[p + 1][j]
                out[every, code[j] if np.ndim(code) else code] += np.where(i >= 0, np.clip(x, start, end) - start, 0)
        return out

    def between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(len(a), n_classes) ns per class inside each [a, b)."""
        return self.upto(b) - self.upto(a)


CHUNK_ROWS = 1 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_NAME = "trainbpf-analyzers"


def run_parallel(jobs: list[Callable[[], Any]]) -> list[Any]:
    """The results of independent jobs, in order, run on every CPU: numpy lets go of the
    GIL inside its loops, so chunks of a long pass run side by side.  Jobs share memory
    only to read it, or to write disjoint slices of it.  Jobs that start jobs run those
    themselves (a pool's worker waiting on the pool could wait forever)."""
    global _POOL
    if len(jobs) < 2 or (os.cpu_count() or 1) < 2 or threading.current_thread().name.startswith(_POOL_NAME):
        return [job() for job in jobs]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(os.cpu_count(), thread_name_prefix=_POOL_NAME)
    return list(_POOL.map(lambda job: job(), jobs))


def row_chunks(n: int):
    """Slices of range(n), CHUNK_ROWS rows each: passes over tens of millions of rows go
    a chunk at a time so their temporaries stay small."""
    return (slice(lo, min(n, lo + CHUNK_ROWS)) for lo in range(0, n, CHUNK_ROWS))


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


def stable_order(rank: np.ndarray) -> np.ndarray:
    """The stable sort order of small non-negative integers (below 2**32): numpy sorts
    16-bit integers by radix, so wider ones go in two 16-bit passes, low half first."""
    if not len(rank) or rank.max() < 1 << 16:
        return np.argsort(rank.astype(np.uint16), kind="stable")
    order = np.argsort((rank & 0xFFFF).astype(np.uint16), kind="stable")
    return order[np.argsort((rank[order] >> 16).astype(np.uint16), kind="stable")]


def sort_by_thread(tid: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The order that sorts rows by (tid, start), ties kept in input order.

    Rows are grouped by thread with a (radix) sort of their small dense rank, then each
    thread's rows sorted by time: recorded rows arrive nearly sorted by time, where a
    stable sort is fast."""
    tid, start = np.asarray(tid), np.asarray(start)
    if in_thread_order(tid, start):
        return np.arange(len(tid))
    order = stable_order(dense_rank(tid)[1])
    for a, b in thread_ranges(tid[order]).values():  # a loop over threads
        rows = order[a:b]
        order[a:b] = rows[np.argsort(start[rows], kind="stable")]
    return order


def in_thread_order(tid: np.ndarray, start: np.ndarray) -> bool:
    """Whether rows are sorted by (tid, start) already."""
    later = tid[1:] > tid[:-1]
    later |= (tid[1:] == tid[:-1]) & (start[1:] >= start[:-1])
    return bool(later.all())


def best_overlap(left: pd.DataFrame, right: pd.DataFrame, *, by: str = "tid") -> np.ndarray:
    """For each `left` interval, the position in `right` of the same-`by` interval that
    overlaps it most (-1: none).  Both frames have start_ns/end_ns.

    Per thread, two candidates: of the `right` intervals starting at or before the left
    start, the one reaching furthest; and the first one starting inside the left interval."""
    out = np.full(len(left), -1, dtype=np.int64)
    if not len(left) or not len(right):
        return out
    l_tid, l_start, l_end = as_int64(left[by]), as_int64(left["start_ns"]), as_int64(left["end_ns"])
    r_tid, r_start, r_end = as_int64(right[by]), as_int64(right["start_ns"]), as_int64(right["end_ns"])
    # Rows in (thread, start) order already (the usual case) are taken as slices, not copies.
    l_order = None if in_thread_order(l_tid, l_start) else sort_by_thread(l_tid, l_start)
    r_order = None if in_thread_order(r_tid, r_start) else sort_by_thread(r_tid, r_start)

    def thread(a: int, b: int, c: int, d: int) -> None:
        rows = slice(c, d) if r_order is None else r_order[c:d]
        rs, re = r_start[rows], r_end[rows]
        lpos = slice(a, b) if l_order is None else l_order[a:b]
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
        out[lpos] = np.where(overlap > 0, best + c if r_order is None else rows[best], -1)

    r_ranges = thread_ranges(r_tid if r_order is None else r_tid[r_order])
    l_ranges = thread_ranges(l_tid if l_order is None else l_tid[l_order])
    run_parallel([partial(thread, a, b, *r_ranges[tid])  # a job per thread; each writes its own rows
                  for tid, (a, b) in l_ranges.items() if tid in r_ranges])
    return out
