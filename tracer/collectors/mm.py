"""Collector for probes/mm.bpf.c: mmap_lock waits, reclaim, compaction, NUMA moves and
migrations, and mmap-family calls.  One event struct for six kinds of row, `what` saying
which: its generic slots (ret, arg, arg2, size) hold a different column of each kind, named
here as the kind's view names it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector

# mm_event.what codes, passed to probes/mm.bpf.c as -D MM_<NAME> (defines() below).
WHAT = {
    "LOCK_READ": 1, "LOCK_WRITE": 2, "RECLAIM_DIRECT": 3, "RECLAIM_MEMCG": 4, "COMPACTION": 5,
    "NUMA_MOVE": 6, "NUMA_SWAP": 7, "MIGRATE": 8,
    "SYS_MMAP": 9, "SYS_MUNMAP": 10, "SYS_BRK": 11, "SYS_MADVISE": 12, "SYS_MREMAP": 13,
}
LOCK_READ, LOCK_WRITE = WHAT["LOCK_READ"], WHAT["LOCK_WRITE"]
RECLAIM_DIRECT, RECLAIM_MEMCG, COMPACTION = WHAT["RECLAIM_DIRECT"], WHAT["RECLAIM_MEMCG"], WHAT["COMPACTION"]
NUMA_MOVE, NUMA_SWAP, MIGRATE = WHAT["NUMA_MOVE"], WHAT["NUMA_SWAP"], WHAT["MIGRATE"]
SYSCALLS = {code: name[4:].lower() for name, code in WHAT.items() if name.startswith("SYS_")}


class MmCollector(Collector):
    name = "mm"
    source = "mm.bpf.c"
    tracepoints = (
        "mmap_lock:mmap_lock_start_locking",
        "mmap_lock:mmap_lock_acquire_returned",
        "vmscan:mm_vmscan_direct_reclaim_begin",
        "vmscan:mm_vmscan_direct_reclaim_end",
        "compaction:mm_compaction_begin",
        "compaction:mm_compaction_end",
        "sched:sched_move_numa",
        "sched:sched_swap_numa",
        "migrate:mm_migrate_pages",
        "syscalls:sys_enter_mmap",
        "syscalls:sys_enter_munmap",
        "syscalls:sys_enter_brk",
        "syscalls:sys_enter_madvise",
        "syscalls:sys_enter_mremap",
    )
    optional_tracepoints = ("vmscan:mm_vmscan_memcg_reclaim_begin",)
    ringbufs = ("mm_events",)

    def defines(self) -> dict[str, int]:
        return {f"MM_{name}": code for name, code in WHAT.items()}

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        what = r["what"]
        common = lambda m: {  # noqa: E731 - the columns every mm row has
            "ts_ns": r["ts_ns"][m].astype(np.int64),
            "tid": r["tid"][m].astype(np.int32),
            "pid": r["pid"][m].astype(np.int32),
        }
        batches = []
        m = (what == LOCK_READ) | (what == LOCK_WRITE)
        if m.any():
            batches.append(make_batch("mmap_lock", {
                **common(m), "dur_ns": r["dur_ns"][m].astype(np.int64),
                "state": np.where(what[m] == LOCK_WRITE, "write", "read").astype(object),
                "acquired": r["ret"][m].astype(np.int64),
            }))
        m = (what == RECLAIM_DIRECT) | (what == RECLAIM_MEMCG)
        if m.any():
            batches.append(make_batch("reclaim", {
                **common(m), "dur_ns": r["dur_ns"][m].astype(np.int64),
                "state": np.where(what[m] == RECLAIM_MEMCG, "memcg", "direct").astype(object),
                "pages_reclaimed": r["ret"][m].astype(np.int64),
            }))
        m = what == COMPACTION
        if m.any():
            batches.append(make_batch("compaction", {
                **common(m), "dur_ns": r["dur_ns"][m].astype(np.int64),
                "status": r["ret"][m].astype(np.int32),
            }))
        m = (what == NUMA_MOVE) | (what == NUMA_SWAP)
        if m.any():
            batches.append(make_batch("numa_move", {
                **common(m), "cpu": r["ret"][m].astype(np.int32), "src_node": r["arg"][m],
                "dst_node": r["arg2"][m],
                "move": np.where(what[m] == NUMA_SWAP, "swap", "move").astype(object),
            }))
        m = what == MIGRATE
        if m.any():
            batches.append(make_batch("numa_migrate", {
                **common(m), "pages_migrated": r["ret"][m].astype(np.int64),
                "pages_failed": r["size"][m].astype(np.int64), "reason": r["arg"][m],
            }))
        m = np.isin(what, list(SYSCALLS))
        if m.any():
            batches.append(make_batch("mm_syscall", {
                **common(m), "dur_ns": r["dur_ns"][m].astype(np.int64),
                "syscall": np.array([SYSCALLS[int(w)] for w in what[m]], dtype=object),
                "addr": r["addr"][m], "length": r["size"][m].astype(np.int64),
                "flags": r["arg"][m], "ret": r["ret"][m].astype(np.int64),
            }))
        return batches
