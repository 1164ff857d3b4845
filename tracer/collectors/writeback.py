"""Collector for probes/writeback.bpf.c: balance_dirty_pages pauses of traced writers,
and the pages written back and folios dirtied per inode by every task, counted in the
kernel per bucket (`writeback_inode` and `dirtied` rows)."""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.bucketed import BucketCounts, bucket_span, issuers
from trainbpf.tracer.collector import Collector, cstrings

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# (bucket, device, inode, task) keys one flush can hold, of pages written back and of
# folios dirtied, each in its own map: ten 100 ms buckets of the inodes being written
# back or dirtied (a sync of thousands of small files fills one); past it, counted as lost.
WRITTEN_ENTRIES = 16384
DIRTIED_ENTRIES = 16384
INODE_KEY = ("bucket", "bdi", "ino", "tid")
# the probe's INODE_WRITTEN and INODE_DIRTIED codes (their maps), in order: the kinds they make
INODE_COUNTED = (("written_inodes", "writeback_inode"), ("dirtied_inodes", "dirtied"))


class WritebackCollector(Collector):
    name = "writeback"
    source = "writeback.bpf.c"
    tracepoints = ("writeback:balance_dirty_pages", "writeback:writeback_single_inode",
                   "writeback:writeback_dirty_folio")
    ringbufs = ("writeback_events",)

    def __init__(self, settings):
        super().__init__(settings)
        self.counts = {kind: BucketCounts(table, settings.disk_bucket_ns, INODE_KEY, ("count",))
                       for table, kind in INODE_COUNTED}
        self.visible: Callable[[int], bool] | None = None  # under sudo: whose tasks may be named

    def defines(self) -> dict[str, int]:
        return {"WRITTEN_ENTRIES": WRITTEN_ENTRIES, "DIRTIED_ENTRIES": DIRTIED_ENTRIES, "INODE_WRITTEN": 0,
                "INODE_DIRTIED": 1}

    def open(self, session) -> None:
        super().open(session)
        if session.gate is not None:
            self.visible = session.gate.sees

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        return [
            make_batch(
                "dirty_pause",
                {
                    "ts_ns": r["ts_ns"].astype(np.int64),
                    "dur_ns": r["dur_ns"].astype(np.int64),
                    "tid": r["tid"].astype(np.int32),
                    "pid": r["pid"].astype(np.int32),
                    "dirty_pages": r["dirty_pages"].astype(np.int64),
                    "limit_pages": r["limit_pages"].astype(np.int64),
                    "device": np.array(cstrings(r["device"]), dtype=object),
                },
            )
        ]

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        return [batch for kind, counts in self.counts.items()
                for batch in inode_batches(kind, counts.drain(bpf, now_ns, final=final), counts.width, self.visible)]


def inode_batches(kind: str, counts: dict[str, np.ndarray], width: int,
                  visible: Callable[[int], bool] | None = None) -> list[pa.RecordBatch]:
    """`writeback_inode` (pages written back, as bytes) or `dirtied` (folios) rows of
    BucketCounts columns (bucket, bdi, ino, tid, count, pid, comm)."""
    if not len(counts["bucket"]):
        return []
    count = counts["count"]
    counted = {"bytes": count * PAGE_SIZE} if kind == "writeback_inode" else {"folios": count}
    return [make_batch(kind, {
        **bucket_span(counts["bucket"], width),
        **issuers(counts["tid"], counts["pid"], counts["comm"], visible),
        "device": counts["bdi"],
        "inode": counts["ino"].astype(np.uint64),
        **counted,
    })]
