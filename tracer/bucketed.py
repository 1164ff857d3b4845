"""Counts a probe keeps in a BPF hash per time bucket and task (the disk, writeback,
writepath, net and tlb probes), as trace rows.

The hash is drained whole at every flush (atomically, tracer/collector.py drain_hash), so
the bucket still counting would be cut in two rows; BucketCounts keeps it until a later
drain adds the rest, and each (bucket, key) becomes one row."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.tracer.collector import cstrings, drain_hash


class BucketCounts:
    """One hash's counts across drains: `key_fields` name the hash key's fields, bucket
    first; `count_fields` the value's sums, then `max_fields` its maxima.  With `task`
    the value also holds the task's `pid` and `comm`, which every row carries."""

    def __init__(self, table_name: str, width: int, key_fields: tuple[str, ...], count_fields: tuple[str, ...],
                 *, max_fields: tuple[str, ...] = (), task: bool = True):
        self.table_name = table_name
        self.width = width
        self.key_fields = key_fields
        self.count_fields = count_fields
        self.max_fields = max_fields
        self.task = task
        self.open: dict[str, np.ndarray] | None = None  # the columns of buckets still counting

    def drain(self, bpf, now_ns: int, *, final: bool) -> dict[str, np.ndarray]:
        """The columns (key fields, counts, maxima[, pid, comm]; a char array as str) of the buckets
        that ended by `now_ns` (every bucket when `final`), each key once.  Merged with
        numpy, not row by row: the machine's writeback and dirtying bring ~1,000 keys a
        second, every task's (most of the counts' CPU was their rows made in Python)."""
        keys, values = drain_hash(bpf[self.table_name])
        drained = {**{f: _chars(keys[f]) for f in self.key_fields},
                   **{f: values[f].astype(np.int64) for f in self.count_fields + self.max_fields}}
        if self.task:
            drained.update(pid=values["pid"].astype(np.int64), comm=_chars(values["comm"]))
        if self.open is not None:  # held first: a key's first pid and comm are kept
            drained = {f: np.concatenate([self.open[f], column]) for f, column in drained.items()}
        merged = self._merged(drained)
        still = np.zeros(len(merged["bucket"]), dtype=bool) if final else merged["bucket"] >= now_ns // self.width
        self.open = {f: column[still] for f, column in merged.items()} if still.any() else None
        ended = {f: column[~still] for f, column in merged.items()}
        return {f: cstrings(column) if column.dtype.kind == "S" else column for f, column in ended.items()}

    def _merged(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`columns` with the rows of one key as one: their counts summed, their maxima the
        largest, the first's pid and comm (a stable sort keeps the held row first)."""
        n = len(columns["bucket"])
        if n < 2:
            return columns
        order = np.lexsort([columns[f] for f in reversed(self.key_fields)])
        columns = {f: column[order] for f, column in columns.items()}
        same = np.ones(n - 1, dtype=bool)  # a row's key is its predecessor's
        for f in self.key_fields:
            same &= columns[f][1:] == columns[f][:-1]
        starts = np.flatnonzero(np.concatenate(([True], ~same)))
        if len(starts) == n:  # every key once: most drains
            return columns
        merge = {**dict.fromkeys(self.count_fields, np.add), **dict.fromkeys(self.max_fields, np.maximum)}
        return {f: merge[f].reduceat(column, starts) if f in merge else column[starts] for f, column in columns.items()}


def _chars(column: np.ndarray) -> np.ndarray:
    """A key or value field: a char array (an (N,) array of S1 per entry, as bcc's ctypes
    make char[N]) as one SN value per entry, numbers as they are."""
    if column.ndim == 2:
        return np.ascontiguousarray(column).view(f"S{column.shape[1]}").reshape(-1)
    return column


def bucket_span(buckets: np.ndarray, width: int) -> dict[str, np.ndarray]:
    """ts_ns (each bucket's start) and dur_ns (its length) of bucket numbers."""
    start = np.array(buckets, dtype=np.int64) * width
    return {"ts_ns": start, "dur_ns": np.full(len(start), width, dtype=np.int64)}


def issuers(tids: np.ndarray | list[int], pids: np.ndarray | list[int], comms: list[str],
            visible: Callable[[int], bool] | None) -> dict[str, pa.Array | np.ndarray]:
    """The tid, pid and comm columns of counted tasks; a task whose process `visible`
    says the invoking user could not see (under sudo, /proc mounted with hidepid) is
    recorded unnamed: tid 0, no pid, comm ""."""
    hidden = np.zeros(len(tids), dtype=bool)
    if visible is not None:
        seen: dict[int, bool] = {}
        for i, pid in enumerate(np.asarray(pids).tolist()):
            if pid not in seen:
                seen[pid] = visible(pid)
            hidden[i] = not seen[pid]
    tid = np.where(hidden, 0, np.array(tids, dtype=np.int64)).astype(np.int32)
    pid = np.array(pids, dtype=np.int32)
    comm = np.array(comms, dtype=object)
    comm[hidden] = ""
    return {"tid": tid, "pid": pa.array(pid, mask=hidden), "comm": comm}
