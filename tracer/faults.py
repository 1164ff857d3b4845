"""Collector for probes/faults.bpf.c: user page faults counted per thread and bucket."""

from __future__ import annotations

import pyarrow as pa

from trainbpf.tracer.collector import Collector, bucket_batches, drain_hash


RAW_TRACEPOINT = "page_fault_user"  # attached raw (faults.bpf.c), checked in tracefs by its full name


class FaultsCollector(Collector):
    name = "faults"
    source = "faults.bpf.c"
    tracepoints = ("exceptions:page_fault_user",)

    def defines(self) -> dict[str, int]:
        return {"FAULT_BUCKET_NS": self.settings.fault_bucket_ns}

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        if final:  # stop counting first, so the runs still open in the per-CPU slots are exact
            bpf.detach_raw_tracepoint(tp=RAW_TRACEPOINT)
        counts = [(k.bucket, k.tid, k.pid, getattr(v, "value", v)) for k, v in drain_hash(bpf["fault_counts"])]
        if final:
            counts += [(r.bucket, r.tid, r.pid, r.count) for r in bpf["fault_runs"][0] if r.traced and r.count]
        return bucket_batches("faults", counts, self.settings.fault_bucket_ns)
