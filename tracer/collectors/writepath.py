"""Collector for probes/writepath.bpf.c: how each file a traced thread writes is written
(buffered, O_DIRECT, io_uring, through a shared mapping), counted in the kernel per bucket of disk_bucket_ns and
read out as `write_path` rows at each flush."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.bucketed import BucketCounts, bucket_span
from trainbpf.tracer.collector import Collector, delete_keys
from trainbpf.tracer.disks import KernelDisks

# The path codes of write_key.path (0 unused), passed to the probe as -D WP_<NAME>.
PATHS = ("buffered", "direct", "io_uring", "mapped")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # bytes a mapped write counts per folio dirtied
IOCB_WRITE = 1 << 18  # ki_flags of iomap_dio_rw_begin (its format's print fmt: "WRITE")
IOMAP_WRITE = 1 << 0  # flags of iomap_iter (its print fmt: "WRITE")
# io_uring opcodes that write a file (include/uapi/linux/io_uring.h): WRITEV, WRITE_FIXED,
# WRITE, WRITEV_FIXED (6.15).
IO_URING_WRITE_OPS = (2, 5, 23, 61)
WRITE_ENTRIES = 16384  # (bucket, thread, file, path) counts between two flushes


class WritePathCollector(Collector):
    name = "writepath"
    source = "writepath.bpf.c"
    tracepoints = tuple(f"syscalls:sys_{edge}_{call}" for edge in ("enter", "exit")
                        for call in ("write", "pwrite64", "writev", "pwritev", "pwritev2")) + (
        "writeback:writeback_dirty_folio",)
    fields_at = {"writeback:writeback_dirty_folio": ("name", "ino")}  # `mapped`: TRACEPOINT_PROBE is writeback's
    # Each names files on the file systems that have it; a kernel lacking one counts less.
    optional_tracepoints = ("iomap:iomap_dio_rw_begin", "iomap:iomap_iter", "ext4:ext4_da_write_begin",
                            "ext4:ext4_write_begin", "io_uring:io_uring_submit_req")

    def __init__(self, settings):
        super().__init__(settings)
        self.disks = KernelDisks()
        # the key holds the writer's pid: the value holds only the counts
        self.counts = BucketCounts("write_counts", settings.disk_bucket_ns,
                                   ("bucket", "tid", "pid", "dev", "ino", "path"), ("bytes", "calls"), task=False)

    def defines(self) -> dict[str, int]:
        return {
            "WRITE_ENTRIES": WRITE_ENTRIES,
            **{f"WP_{path.upper()}": code for code, path in enumerate(PATHS, 1)},
            "PAGE_BYTES": PAGE_BYTES,
            "IOCB_WRITE_FLAG": IOCB_WRITE,
            "IOMAP_WRITE_FLAG": IOMAP_WRITE,
            "IO_URING_WRITE_OPS": sum(1 << op for op in IO_URING_WRITE_OPS),
        }

    def attach(self, bpf) -> None:
        # Named apart from probes/writeback.bpf.c's program on the same tracepoint.  bcc
        # keeps one perf event per tracepoint name: the second would replace the first's
        # and leave it open after detach (loader.detach closes what tracepoint_fds hold),
        # so it is kept under a name of its own (bcc's detach of a tracepoint by name is
        # only the close of its perf event).
        tp = b"writeback:writeback_dirty_folio"
        first = bpf.tracepoint_fds.pop(tp, None)
        bpf.attach_tracepoint(tp=tp, fn_name="writepath_dirty_folio")
        bpf.tracepoint_fds[tp + b".writepath"] = bpf.tracepoint_fds.pop(tp)
        if first is not None:
            bpf.tracepoint_fds[tp] = first

    def device(self, dev: int) -> str:
        """A kernel dev_t as its whole disk "MAJ:MIN"; "" for none (io_uring rows)."""
        return "" if dev == 0 else self.disks.name(dev)

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        counts = self.counts.drain(bpf, now_ns, final=final)
        if not len(counts["bucket"]):
            return []
        return [make_batch("write_path", {
            **bucket_span(counts["bucket"], self.counts.width),
            "tid": counts["tid"].astype(np.int32),
            "pid": counts["pid"].astype(np.int32),
            "calls": counts["calls"],
            "bytes": counts["bytes"],
            "device": np.array([self.device(d) for d in counts["dev"].tolist()], dtype=object),
            "inode": counts["ino"].astype(np.uint64),
            "path": np.array([PATHS[p - 1] for p in counts["path"].tolist()], dtype=object),
        })]

    def forget(self, bpf, tids: list[int]) -> None:
        delete_keys(bpf["write_calls"], tids)
