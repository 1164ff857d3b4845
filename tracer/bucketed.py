"""Counts a probe keeps in a BPF hash per time bucket and issuing task, for every task on
the machine (probes/disk.bpf.c, probes/writeback.bpf.c), as trace rows.

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
        self.task_fields = ("pid", "comm") if task else ()
        self.open: dict[tuple, list] = {}  # (bucket, ...) -> [counts..., pid, comm] of buckets still counting

    def drain(self, bpf, now_ns: int, *, final: bool) -> list[tuple]:
        """Rows (bucket, *other key fields, *counts, *maxima[, pid, comm]) of the buckets
        that ended by `now_ns` (every bucket when `final`), each key once."""
        keys, values = drain_hash(bpf[self.table_name])
        merged, self.open = self.open, {}
        if len(keys):
            key_rows = zip(*(_values(keys[f]) for f in self.key_fields))
            value_rows = zip(*(_values(values[f]) for f in self.count_fields + self.max_fields + self.task_fields))
            counted, maxed = len(self.count_fields), len(self.count_fields) + len(self.max_fields)
            for key, value in zip(key_rows, value_rows):
                held = merged.get(key)
                if held is None:
                    merged[key] = list(value)
                    continue
                for i in range(counted):
                    held[i] += value[i]
                for i in range(counted, maxed):
                    held[i] = max(held[i], value[i])
        current = now_ns // self.width
        rows = []
        for key, value in merged.items():
            if not final and key[0] >= current:
                self.open[key] = value
            else:
                rows.append(key + tuple(value))
        return rows


def _values(column: np.ndarray) -> list:
    """A field's values: numbers, or a char array as str (a bdi name, a comm)."""
    return cstrings(column) if column.ndim == 2 or column.dtype.kind == "S" else column.tolist()


def bucket_span(buckets: list[int], width: int) -> dict[str, np.ndarray]:
    """ts_ns (each bucket's start) and dur_ns (its length) of bucket numbers."""
    start = np.array(buckets, dtype=np.int64) * width
    return {"ts_ns": start, "dur_ns": np.full(len(start), width, dtype=np.int64)}


def issuers(tids: list[int], pids: list[int], comms: list[str],
            visible: Callable[[int], bool] | None) -> dict[str, pa.Array | np.ndarray]:
    """The tid, pid and comm columns of counted tasks; a task whose process `visible`
    says the invoking user could not see (under sudo, /proc mounted with hidepid) is
    recorded unnamed: tid 0, no pid, comm ""."""
    hidden = np.zeros(len(tids), dtype=bool)
    if visible is not None:
        seen: dict[int, bool] = {}
        for i, pid in enumerate(pids):
            if pid not in seen:
                seen[pid] = visible(pid)
            hidden[i] = not seen[pid]
    tid = np.where(hidden, 0, np.array(tids, dtype=np.int64)).astype(np.int32)
    pid = np.array(pids, dtype=np.int32)
    comm = np.array(comms, dtype=object)
    comm[hidden] = ""
    return {"tid": tid, "pid": pa.array(pid, mask=hidden), "comm": comm}
