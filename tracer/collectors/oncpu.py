"""Collector for probes/oncpu.bpf.c: CPU-clock samples of traced threads with stacks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector, py_stack_ids, stack_ids


class OnCpuCollector(Collector):
    name = "oncpu"
    source = "oncpu.bpf.c"
    ringbufs = ("oncpu_events",)

    def attach(self, bpf) -> None:
        from bcc import PerfSWConfig, PerfType

        bpf.attach_perf_event(
            ev_type=PerfType.SOFTWARE,
            ev_config=PerfSWConfig.CPU_CLOCK,
            fn_name="on_cpu_sample",
            sample_freq=self.settings.oncpu_hz,
            cpu=-1,
        )

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        return [
            make_batch(
                "oncpu",
                {
                    "ts_ns": r["ts_ns"].astype(np.int64),
                    "tid": r["tid"].astype(np.int32),
                    "pid": r["pid"].astype(np.int32),
                    "cpu": r["cpu"],
                    "kstack_id": stack_ids(r["kstack_id"]),
                    "ustack_id": stack_ids(r["ustack_id"]),
                    "pystack_id": py_stack_ids(r["pystack_id"]),
                },
            )
        ]
