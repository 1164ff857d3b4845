"""Per-thread delay accounting (taskstats over netlink, via pyroute2) at start and end."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch

DELAY_FIELDS = (
    "cpu_delay_total", "blkio_delay_total", "swapin_delay_total", "freepages_delay_total",
    "thrashing_delay_total", "compact_delay_total", "wpcopy_delay_total", "irq_delay_total",
)


def delayacct_enabled() -> bool:
    try:
        with open("/proc/sys/kernel/task_delayacct") as fh:
            return fh.read().strip() == "1"
    except OSError:
        return False


def snapshot(threads: dict[int, int], phase: str) -> pa.RecordBatch | None:
    """Delay totals of each thread (`threads`: tid -> tgid); threads gone or a missing
    netlink family are skipped."""
    try:
        from pyroute2 import TaskStats

        ts = TaskStats()
        ts.bind()
    except Exception:
        return None
    rows = []
    now = time.monotonic_ns()
    try:
        for tid, tgid in threads.items():
            try:
                msg = ts.get_pid_stat(tid)[0]
                stats = msg.get_attr("TASKSTATS_TYPE_AGGR_PID").get_attr("TASKSTATS_TYPE_STATS")
            except Exception:  # thread gone, or no permission
                continue
            for f in DELAY_FIELDS:
                if f in stats:
                    rows.append((tid, tgid, f[: -len("_total")], int(stats[f])))
    finally:
        ts.close()
    if not rows:
        return None
    return make_batch("taskstats", {
        "ts_ns": np.full(len(rows), now, dtype=np.int64),
        "tid": np.array([r[0] for r in rows], dtype=np.int32),
        "pid": np.array([r[1] for r in rows], dtype=np.int32),
        "state": [phase] * len(rows),
        "field": [r[2] for r in rows],
        "total_ns": np.array([r[3] for r in rows], dtype=np.int64),
    })
