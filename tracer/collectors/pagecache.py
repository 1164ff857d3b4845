"""Collector for probes/pagecache.bpf.c: pages every file gains and loses in the page
cache, and those read back after being dropped, counted in the kernel per bucket of
disk_bucket_ns and read out as `page_cache` rows at each flush."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector, drain_hash
from trainbpf.tracer.disks import KernelDisks

# The change codes of page_cache_key.change (0 unused), passed to the probe as -D PC_<NAME>.
CHANGES = ("added", "dropped", "refaulted")
PAGE_CACHE_ENTRIES = 16384  # (bucket, file, change) counts between two flushes
# Dropped pages are remembered per granule of 1 << REFAULT_SHIFT pages (128 KiB: the
# default readahead window, so a re-read lands on the granules its pages left).
REFAULT_SHIFT = 5
MAX_FOLIO_ORDER = 9  # the largest page cache folio on x86-64: a PMD, 2 MiB


class PageCacheCollector(Collector):
    name = "pagecache"
    source = "pagecache.bpf.c"
    tracepoints = ("filemap:mm_filemap_add_to_page_cache", "filemap:mm_filemap_delete_from_page_cache")
    # Every process's files, none a traced thread's event, yet named like the disk
    # counts' (tracer/samplers/files.py): described as the probes' rows are.
    # Every page cache change on the machine runs it: ~1.7-1.9 us each (docs/performance.md).
    opt_in = True

    def __init__(self, settings):
        super().__init__(settings)
        self.disks = KernelDisks()

    def defines(self) -> dict[str, int]:
        return {"PAGE_CACHE_ENTRIES": PAGE_CACHE_ENTRIES, "REFAULT_SHIFT": REFAULT_SHIFT,
                "REFAULT_SPAN": 1 << (MAX_FOLIO_ORDER - REFAULT_SHIFT),
                **{f"PC_{change.upper()}": code for code, change in enumerate(CHANGES, 1)}}

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        # A bucket still counting when drained goes on in a new entry: its rows add up.
        keys, pages = drain_hash(bpf["page_cache_counts"])
        if not len(keys):
            return []
        width = self.settings.disk_bucket_ns
        return [make_batch("page_cache", {
            "ts_ns": keys["bucket"].astype(np.int64) * width,
            "dur_ns": np.full(len(keys), width, dtype=np.int64),
            "device": [self.disks.name(dev) for dev in keys["dev"].tolist()],
            "inode": keys["ino"].astype(np.uint64),
            "change": [CHANGES[code - 1] for code in keys["change"].tolist()],
            "pages": pages.astype(np.int64),
        })]
