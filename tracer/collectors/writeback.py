"""Collector for probes/writeback.bpf.c: balance_dirty_pages pauses of traced writers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector, cstrings


class WritebackCollector(Collector):
    name = "writeback"
    source = "writeback.bpf.c"
    tracepoints = ("writeback:balance_dirty_pages",)
    ringbufs = ("writeback_events",)

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
