"""Collector for probes/block.bpf.c: block requests of traced threads and their latency."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector, cstrings


class BlockCollector(Collector):
    name = "block"
    source = "block.bpf.c"
    tracepoints = ("block:block_rq_insert", "block:block_rq_issue", "block:block_rq_complete")
    ringbufs = ("block_events",)

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        return [
            make_batch(
                "block_rq",
                {
                    "ts_ns": r["ts_ns"].astype(np.int64),
                    "dur_ns": r["dur_ns"].astype(np.int64),
                    "tid": r["tid"].astype(np.int32),
                    "pid": r["pid"].astype(np.int32),
                    "bytes": r["bytes"].astype(np.int64),
                    "rwbs": np.array(cstrings(r["rwbs"]), dtype=object),
                    "dev": r["dev"].astype(np.int32),
                    "sector": r["sector"],
                },
            )
        ]
