"""What a symbolised stack says a thread was doing.

``stack`` rows carry frames leaf first, joined by ";".  Each distinct stack is classified
once by substring patterns (a few thousand stacks at most), then stack ids are mapped to
classes with array lookups.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import as_int64

# Kernel stack classes, most specific first: reclaim inside a fault is reclaim, a fault
# waiting for the mmap_lock is mmap_lock contention, a fault waiting for a read is a fault.
KERNEL_PATTERNS: tuple[tuple[str, str], ...] = (
    ("dirty_throttling", r"balance_dirty_pages"),
    ("memory_reclaim", r"shrink_|try_to_free|compact_|direct_reclaim|mem_cgroup_handle_over_high"),
    # An rwsem wait reached from mmap/munmap or the fault path is the mmap_lock.
    ("mmap_lock", r"lock_mm_and_find_vma|^(?=.*rwsem)(?=.*(?:mmap|do_user_addr_fault|lock_mm))"),
    ("page_faults", r"handle_mm_fault|do_user_addr_fault|exc_page_fault|do_page_fault"),
    ("allocator_churn", r"munmap|do_mmap|zap_pte_range|unmap_page_range|unmap_region|madvise|do_brk|mremap"),
    ("block_io", r"io_schedule|blk_|folio_wait|wait_on_page_bit|__lock_page|submit_bio"),
    ("futex", r"futex_wait"),
)

# User stack classes: the GIL, a lock routine, the allocator (for lock evidence).
USER_PATTERNS: tuple[tuple[str, str], ...] = (
    ("gil", r"take_gil|PyEval_AcquireThread|PyEval_RestoreThread|PyEval_AcquireLock|PyGILState_Ensure"),
    ("lock", r"pthread_mutex_lock|__lll_lock_wait|pthread_rwlock_|pthread_spin_lock|lll_lock|__pthread_mutex_cond_lock"),
)
ALLOCATOR_PATTERN = r"malloc|free|arena|tcache|calloc|realloc|je_|tc_"

# Class vocabulary; "" (code 0) when nothing matched.  Hot paths compare integer codes.
STACK_CLASSES: tuple[str, ...] = ("",) + tuple(n for n, _ in KERNEL_PATTERNS) + tuple(n for n, _ in USER_PATTERNS)
STACK_CLASS_DTYPE = pd.CategoricalDtype(STACK_CLASSES)
CLASS_CODE = {name: np.int8(i) for i, name in enumerate(STACK_CLASSES)}
STACK_COLUMNS = ("stack_id", "kernel", "cls", "allocator", "frames")
# Stack ids below this are looked up in a table indexed by id, larger ones by search.
MAX_TABLE_ID = 1 << 24


def classify_stacks(stack: pd.DataFrame) -> pd.DataFrame:
    """One row per stack id: whether it is a kernel stack, its class (STACK_CLASSES),
    whether it runs through the allocator, and its frames."""
    df = pd.DataFrame(
        {
            "stack_id": as_int64(stack["stack_id"]),
            "kernel": stack["space"].fillna("").astype(str).to_numpy(dtype=object) != "user",
            "frames": stack["frames"].fillna("").astype(str).to_numpy(dtype=object),
        }
    ).drop_duplicates("stack_id", keep="last")
    frames = df["frames"].astype(str)
    cls = np.zeros(len(df), dtype=np.int8)
    for kernel, patterns in ((True, KERNEL_PATTERNS), (False, USER_PATTERNS)):
        # Walk from the least to the most specific pattern so the most specific wins.
        for name, pattern in reversed(patterns):
            hit = frames.str.contains(pattern, regex=True).to_numpy(dtype=bool) & (df["kernel"].to_numpy() == kernel)
            cls[hit] = CLASS_CODE[name]
    df["cls"] = pd.Categorical.from_codes(cls, dtype=STACK_CLASS_DTYPE)
    df["allocator"] = frames.str.contains(ALLOCATOR_PATTERN, regex=True).to_numpy(dtype=bool) & ~df["kernel"].to_numpy()
    df["frames"] = frames
    return df[list(STACK_COLUMNS)].reset_index(drop=True)


def stack_class_codes(stacks: pd.DataFrame, ids: object) -> np.ndarray:
    """The class code (CLASS_CODE) of each stack id in `ids`; 0 for unknown or null ids."""
    ids = as_int64(ids)
    out = np.zeros(len(ids), dtype=np.int8)
    if not len(stacks) or not len(ids):
        return out
    sid = stacks["stack_id"].to_numpy(np.int64)
    cls = stacks["cls"].cat.codes.to_numpy()
    if sid.min() >= 0 and sid.max() < MAX_TABLE_ID:
        # Stack ids are small and unique (classify_stacks): a lookup table.
        table = np.zeros(int(sid.max()) + 1, dtype=np.int8)
        table[sid] = cls
        known = (ids >= 0) & (ids < len(table))
        out[known] = table[ids[known]]
        return out
    order = np.argsort(sid, kind="stable")
    sid, cls = sid[order], cls[order]
    pos = np.clip(np.searchsorted(sid, ids), 0, len(sid) - 1)
    hit = sid[pos] == ids
    out[hit] = cls[pos[hit]]
    return out


def stack_excerpt(stacks: pd.DataFrame, stack_id: int, frames: int = 6) -> str:
    """The leaf-most frames of a stack, for evidence."""
    row = stacks.loc[stacks["stack_id"] == stack_id, "frames"]
    if not len(row):
        return ""
    return ";".join(str(row.iloc[0]).split(";")[:frames])
