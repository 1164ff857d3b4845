"""Collector for probes/futex.bpf.c: futex waits with address, command and user stack."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector, delete_keys, py_stack_ids, stack_ids


class FutexCollector(Collector):
    name = "futex"
    source = "futex.bpf.c"
    tracepoints = ("syscalls:sys_enter_futex", "syscalls:sys_exit_futex")
    optional_tracepoints = ("syscalls:sys_enter_futex_wait", "syscalls:sys_enter_futex_waitv")
    ringbufs = ("futex_events",)

    def forget(self, bpf, tids: list[int]) -> None:
        """An exited thread's entry (futex.bpf.c keeps one per thread)."""
        delete_keys(bpf["futex_waiting"], tids)

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        return [
            make_batch(
                "futex",
                {
                    "ts_ns": r["ts_ns"].astype(np.int64),
                    "dur_ns": r["dur_ns"].astype(np.int64),
                    "tid": r["tid"].astype(np.int32),
                    "pid": r["pid"].astype(np.int32),
                    "addr": r["addr"],
                    "futex_op": r["futex_op"],
                    "ustack_id": stack_ids(r["ustack_id"]),
                    "pystack_id": py_stack_ids(r["pystack_id"]),
                },
            )
        ]
