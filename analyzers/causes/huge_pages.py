"""Huge pages: whether the traced processes' fresh memory came in 2 MiB pages or in
4 KiB ones, and what huge pages would save.

A process that maps memory and touches it takes one fault per page: about 256 a MiB
with 4 KiB pages, about 0.5 with transparent huge pages (2 MiB).  The bytes newly mapped
are the `mm_syscall` rows' (mmap and mremap lengths, successful calls only): exact per
process and call, where anonymous memory growth would only be sampled, and counts
memory that is mapped, freed and mapped again as often as it happens, which is what
churn costs.  The faults are the `faults` rows' (every fault the process's threads
took, also on memory mapped before the recording: a process that maps little has no
ratio, MIN_MAPPED_BYTES).  The THP mode (the trace's `thp` metadata) and the kernel's
thp_fault_alloc / thp_fault_fallback counters (the `vmstat` rows, node-wide) say why.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import Span, as_int64

MIB = 1 << 20
SMALL_PAGE_FAULTS_PER_MIB = MIB / 4096  # 256
HUGE_PAGE_FAULTS_PER_MIB = MIB / (2 << 20)  # 0.5
# Between the two (geometric middle ~11): fewer faults a MiB means mostly huge pages.
HUGE_MAX_FAULTS_PER_MIB = 16.0
# A process that mapped less has no ratio: its faults are mostly on older memory.
MIN_MAPPED_BYTES = 8 * MIB
# What the syscall rows map: the length of mmap and mremap (the new length).
MAPPING_SYSCALLS = ("mmap", "mremap")
# The node-wide THP counters the evidence quotes (vmstat deltas over the window).
THP_COUNTERS = ("thp_fault_alloc", "thp_fault_fallback")
PAGE_COLUMNS = ("pid", "mapped_bytes", "faults", "faults_per_mib", "huge_pages", "faults_with_huge_pages")


def _in_window(frame: pd.DataFrame, window: Span) -> pd.DataFrame:
    if not len(frame):
        return frame
    ts = as_int64(frame["ts_ns"])
    return frame[(ts >= window.start_ns) & (ts < window.end_ns)]


def process_pages(mm_syscall: pd.DataFrame, faults: pd.DataFrame, window: Span) -> pd.DataFrame:
    """PAGE_COLUMNS, one row per process that mapped at least MIN_MAPPED_BYTES in the
    window (views with meaningful names: `syscall`, `length`, `ret`, `faults`), by pid:
    faults per MiB newly mapped, whether that means huge pages, and the faults the same
    bytes would take in huge pages."""
    mm = _in_window(mm_syscall, window)
    mapped = pd.Series(dtype=np.int64)
    if len(mm):
        ok = mm["syscall"].astype(object).isin(MAPPING_SYSCALLS).to_numpy() & ~_failed(as_int64(mm["ret"], 0))
        size = np.maximum(as_int64(mm["length"], 0), 0)
        mapped = pd.Series(size[ok], index=as_int64(mm["pid"])[ok]).groupby(level=0).sum()
    mapped = mapped[mapped >= MIN_MAPPED_BYTES]
    fl = _in_window(faults, window)
    counts = pd.Series(np.maximum(as_int64(fl["faults"], 0), 0), index=as_int64(fl["pid"])).groupby(level=0).sum() \
        if len(fl) else pd.Series(dtype=np.int64)
    pid = mapped.index.to_numpy(np.int64)
    mapped_bytes = mapped.to_numpy(np.int64)
    fault_count = counts.reindex(pid).fillna(0).to_numpy(np.int64)
    per_mib = fault_count / np.maximum(mapped_bytes / MIB, 1e-9)
    return pd.DataFrame({
        "pid": pid, "mapped_bytes": mapped_bytes, "faults": fault_count, "faults_per_mib": per_mib.astype(np.float64),
        "huge_pages": per_mib <= HUGE_MAX_FAULTS_PER_MIB,
        "faults_with_huge_pages": np.ceil(mapped_bytes / MIB * HUGE_PAGE_FAULTS_PER_MIB).astype(np.int64),
    })[list(PAGE_COLUMNS)]


def _failed(ret: np.ndarray) -> np.ndarray:
    """Syscall returns that are errors (-4095..-1); an mmap address is never one."""
    return (ret < 0) & (ret >= -4095)


def thp_state(meta: Mapping[str, Any], vmstat: pd.DataFrame, window: Span) -> dict[str, Any]:
    """The THP mode the trace recorded (`enabled`, `defrag`; None in older traces) and the
    node-wide THP_COUNTERS' increase over the window."""
    mode = dict(meta.get("thp") or {})
    rows = _in_window(vmstat, window)
    counters = {name: 0 for name in THP_COUNTERS}
    if len(rows):
        key = rows["key"].astype(object).to_numpy()
        delta = as_int64(rows["delta"], 0)
        for name in THP_COUNTERS:
            counters[name] = int(np.maximum(delta[key == name], 0).sum())
    return {"enabled": mode.get("enabled"), "defrag": mode.get("defrag"), **counters}


def page_evidence(pages: pd.DataFrame, pids: list[int], thp: dict[str, Any]) -> dict[str, Any]:
    """What a memory finding says of huge pages for the processes `pids`: whether they
    got their fresh memory in huge pages (`huge_pages`: all of them did) and, over those
    that did not, their faults per MiB newly mapped and the faults huge pages would save
    (`case` "small_pages"); only `thp` when none mapped enough."""
    mine = pages[pages["pid"].isin(pids)]
    if not len(mine):
        return {"thp": thp}
    small = mine[~mine["huge_pages"].to_numpy(bool)]
    judged = small if len(small) else mine
    mapped, faults = int(judged["mapped_bytes"].sum()), int(judged["faults"].sum())
    per_mib = faults / (mapped / MIB)
    with_huge = int(judged["faults_with_huge_pages"].sum())
    out: dict[str, Any] = {
        "thp": thp, "huge_pages": not len(small), "small_page_pids": [int(p) for p in small["pid"]],
        "mapped_bytes": mapped, "faults_per_mib": round(per_mib, 2), "faults_with_huge_pages": with_huge,
        "faults_saved_by_huge_pages": max(faults - with_huge, 0) if len(small) else 0,
    }
    if len(small):
        out["case"] = "small_pages"
        out["names"] = {"faults_per_mib": f"{per_mib:.0f}", "mapped_bytes": mapped,
                        "faults_with_huge_pages": f"{with_huge:,}", "faults": f"{faults:,}",
                        "thp_mode": thp.get("enabled") or "unknown"}
    return out
