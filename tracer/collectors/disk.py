"""Collector for probes/disk.bpf.c: block requests of every issuer, counted in the kernel
per (bucket, device, issuing task, direction), as `disk_io` rows."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.schema import kernel_device
from trainbpf.trace.spool import make_batch
from trainbpf.tracer.bucketed import BucketCounts, bucket_span, issuers
from trainbpf.tracer.collector import Collector

DIRECTIONS = ("read", "write", "other")  # the probe's DISK_READ, ... codes, in order
# (bucket, device, task, direction) keys one flush can hold: ten 100 ms buckets of a few
# hundred issuers on a few devices; past it, requests count as lost.
DISK_ENTRIES = 16384


class DiskCollector(Collector):
    name = "disk"
    source = "disk.bpf.c"
    # block_io_start (6.5+) and the merges it needs; else block_bio_queue (disk.bpf.c)
    tracepoints = ("block:block_bio_queue",)
    optional_tracepoints = ("block:block_io_start", "block:block_bio_backmerge", "block:block_bio_frontmerge")

    def __init__(self, settings):
        super().__init__(settings)
        self.counts = BucketCounts("disk_counts", settings.disk_bucket_ns, ("bucket", "dev", "tid", "direction"),
                                   ("bytes", "requests"))
        self.visible: Callable[[int], bool] | None = None  # under sudo: whose tasks may be named

    def defines(self) -> dict[str, int]:
        return {"DISK_ENTRIES": DISK_ENTRIES, **{f"DISK_{d.upper()}": i for i, d in enumerate(DIRECTIONS)}}

    def open(self, session) -> None:
        super().open(session)
        if session.gate is not None:
            self.visible = session.gate.sees

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        return disk_io_batches(self.counts.drain(bpf, now_ns, final=final), self.counts.width, self.visible)


def disk_io_batches(counts: dict[str, np.ndarray], width: int,
                    visible: Callable[[int], bool] | None = None) -> list[pa.RecordBatch]:
    """`disk_io` rows of BucketCounts columns (bucket, dev, tid, direction, bytes,
    requests, pid, comm)."""
    if not len(counts["bucket"]):
        return []
    direction = counts["direction"]
    return [make_batch("disk_io", {
        **bucket_span(counts["bucket"], width),
        **issuers(counts["tid"], counts["pid"], counts["comm"], visible),
        "device": [kernel_device(d) for d in counts["dev"].tolist()],
        "direction": np.array(DIRECTIONS, dtype=object)[np.where(direction < len(DIRECTIONS), direction, 2)],
        "bytes": counts["bytes"],
        "requests": counts["requests"],
    })]
