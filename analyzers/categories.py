"""The fixed vocabularies every analyzer and every output shares (DESIGN §4)."""

from __future__ import annotations

import numpy as np
import pandas as pd

# Finding categories, in the order the design lists them.
CATEGORIES: tuple[str, ...] = (
    "input_pipeline",
    "cpu_contention",
    "lock_contention",
    "gil_contention",
    "allocator_churn",
    "page_faults",
    "mmap_lock",
    "memory_reclaim",
    "dirty_throttling",
    "block_io",
    "numa_remote",
    "other",
)

# Thread states.  Blocked time is named by its cause; together they tile every traced ns.
#   futex: a futex wait; sleep: an interruptible sleep with no other kernel evidence (pipe,
#   poll, queue, nanosleep); uninterruptible: D state with no other evidence; short_wait:
#   off-CPU intervals below the recorder's min_block_ns, known only as sums.
STATES: tuple[str, ...] = (
    "running",
    "runnable",
    "futex",
    "sleep",
    "page_faults",
    "mmap_lock",
    "memory_reclaim",
    "dirty_throttling",
    "block_io",
    "uninterruptible",
    "short_wait",
    "other",
)

# What a futex wait was, as far as the trace tells: "wait" for something another thread
# does (followed to the waker), a contended "lock", or the "gil"; "none" off futexes.
FUTEX_CLASSES: tuple[str, ...] = ("none", "wait", "lock", "gil")

ROLES: tuple[str, ...] = ("trainer", "dataloader", "pin_memory", "checkpoint", "autograd", "other")

STATE_DTYPE = pd.CategoricalDtype(STATES)
CATEGORY_DTYPE = pd.CategoricalDtype(CATEGORIES)
FUTEX_CLASS_DTYPE = pd.CategoricalDtype(FUTEX_CLASSES)
ROLE_DTYPE = pd.CategoricalDtype(ROLES)

# What the trainer's own blocked state means when it is not followed to a waker.
STATE_CATEGORY: dict[str, str] = {
    "runnable": "cpu_contention",
    "page_faults": "page_faults",
    "mmap_lock": "mmap_lock",
    "memory_reclaim": "memory_reclaim",
    "dirty_throttling": "dirty_throttling",
    "block_io": "block_io",
    "futex": "other",
    "sleep": "other",
    "uninterruptible": "other",
    "short_wait": "other",
    "other": "other",
}

# Blocked states whose cause lies with whoever ended the wait.
FOLLOWED_STATES: frozenset[str] = frozenset({"futex", "sleep", "uninterruptible"})

# What on-CPU samples say a running thread was doing (kernel stack at the sample).
# "user" is ordinary work; the others are stalls that look like running to the scheduler.
RUN_CLASSES: tuple[str, ...] = ("user", "page_faults", "memory_reclaim", "allocator_churn", "mmap_lock", "block_io", "dirty_throttling")
# A starved piece's running class: "" for pieces that were not running.
RUN_CLASS_DTYPE = pd.CategoricalDtype(("",) + RUN_CLASSES)

# Integer codes of the categorical vocabularies: hot paths compare codes, not strings.
STATE_CODE: dict[str, int] = {name: i for i, name in enumerate(STATES)}
CATEGORY_CODE: dict[str, int] = {name: i for i, name in enumerate(CATEGORIES)}
FUTEX_CODE: dict[str, int] = {name: i for i, name in enumerate(FUTEX_CLASSES)}


def codes(values: pd.Series) -> np.ndarray:
    """The integer codes of a categorical column."""
    return values.cat.codes.to_numpy()
