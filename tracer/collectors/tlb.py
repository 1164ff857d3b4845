"""Collector for probes/tlb.bpf.c: TLB shootdowns a traced thread sent (it changed a
mapping other CPUs may cache) or received (a flush IPI interrupted it), counted in the
kernel per (bucket, thread, side), as `tlb_flush` rows."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.bucketed import BucketCounts, bucket_span
from trainbpf.tracer.collector import Collector

SIDES = ("sent", "received")  # the probe's TLB_SENT, TLB_RECEIVED codes, in order
# enum tlb_flush_reason values, as tlb:tlb_flush's print format names them ("remote
# shootdown" (1), "remote IPI send" (4)); tests/test_tlb.py checks them against tracefs.
REASON_CODES = {"remote shootdown": 1, "remote IPI send": 4}
# (bucket, thread, side) keys one flush can hold: ten 100 ms buckets of a few hundred
# threads on both sides; past it, flushes count as lost.
TLB_ENTRIES = 8192
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class TlbCollector(Collector):
    name = "tlb"
    source = "tlb.bpf.c"
    # x86 only (arm64 and others flush without it): without it the probe counts nothing
    optional_tracepoints = ("tlb:tlb_flush",)

    def __init__(self, settings):
        super().__init__(settings)
        self.counts = BucketCounts("tlb_counts", settings.disk_bucket_ns, ("bucket", "tid", "side"),
                                   ("flushes", "pages"), max_fields=("pid", "cpu"), task=False)

    def defines(self) -> dict[str, int]:
        return {"TLB_ENTRIES": TLB_ENTRIES,
                "TLB_REASON_SHOOTDOWN": REASON_CODES["remote shootdown"],
                "TLB_REASON_SEND_IPI": REASON_CODES["remote IPI send"],
                **{f"TLB_{side.upper()}": i for i, side in enumerate(SIDES)}}

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        return tlb_batches(self.counts.drain(bpf, now_ns, final=final), self.counts.width)


def tlb_batches(counts: dict[str, np.ndarray], width: int) -> list[pa.RecordBatch]:
    """`tlb_flush` rows of BucketCounts columns (bucket, tid, side, flushes, pages, pid, cpu)."""
    if not len(counts["bucket"]):
        return []
    return [make_batch("tlb_flush", {
        **bucket_span(counts["bucket"], width),
        "tid": counts["tid"].astype(np.int32),
        "pid": counts["pid"].astype(np.int32),
        "cpu": counts["cpu"].astype(np.int32),
        "side": [SIDES[s] if 0 <= s < len(SIDES) else "?" for s in counts["side"].tolist()],
        "bytes": counts["pages"] * PAGE_SIZE,
        "flushes": counts["flushes"],
    })]
