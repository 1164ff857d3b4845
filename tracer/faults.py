"""Collector for probes/faults.bpf.c: user page faults counted per thread and bucket."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.tracefile import make_batch
from trainbpf.tracer.collector import Collector, drain_hash


class FaultsCollector(Collector):
    name = "faults"
    source = "faults.bpf.c"
    tracepoints = ("exceptions:page_fault_user",)
    lost_names = ("faults",)

    def defines(self) -> dict[str, int]:
        return {"FAULT_BUCKET_NS": self.settings.fault_bucket_ns}

    def drain(self, bpf, now_ns: int) -> list[pa.RecordBatch]:
        items = drain_hash(bpf["fault_counts"])
        if not items:
            return []
        width = self.settings.fault_bucket_ns
        return [
            make_batch(
                "faults",
                {
                    "ts_ns": np.array([k.bucket for k, _ in items], dtype=np.int64) * width,
                    "dur_ns": np.full(len(items), width, dtype=np.int64),
                    "tid": np.array([k.tid for k, _ in items], dtype=np.int32),
                    "pid": np.array([k.pid for k, _ in items], dtype=np.int32),
                    "count": np.array([getattr(v, "value", v) for _, v in items], dtype=np.int64),
                },
            )
        ]
