"""The fixed vocabularies of thread states, futex classes, roles and on-CPU stall classes
that every analyzer and every output shares (docs/design.md §Attribution model).  The
finding categories, and what each state or class means as one, are the registry in
analyzers/causes/categories.py."""

from __future__ import annotations

import numpy as np
import pandas as pd

# Thread states.  Blocked time is named by its cause; together they tile every traced ns.
#   futex: a futex wait; sleep: an interruptible sleep with no other kernel evidence (pipe,
#   poll, queue, nanosleep); network_io: waiting on a socket (a receive, connect, accept, or a
#   poll of a thread that received on a socket then); uninterruptible: D state with no other evidence; short_wait:
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
    "network_io",
    "uninterruptible",
    "short_wait",
    "other",
)

# What a futex wait was, as far as the trace tells: "wait" for something another thread
# does (followed to the waker), a contended "lock", or the "gil"; "none" off futexes.
FUTEX_CLASSES: tuple[str, ...] = ("none", "wait", "lock", "gil")

# "collective": a collective backend's threads (gloo, NCCL), which carry a rank's collectives.
ROLES: tuple[str, ...] = ("trainer", "dataloader", "pin_memory", "checkpoint", "autograd", "collective", "other")

STATE_DTYPE = pd.CategoricalDtype(STATES)
FUTEX_CLASS_DTYPE = pd.CategoricalDtype(FUTEX_CLASSES)
ROLE_DTYPE = pd.CategoricalDtype(ROLES)

# Blocked states whose cause lies with whoever ended the wait.
FOLLOWED_STATES: frozenset[str] = frozenset({"futex", "sleep", "uninterruptible"})

# What on-CPU samples say a running thread was doing (kernel stack at the sample).
# "user" is ordinary work; the others are stalls that look like running to the scheduler.
RUN_CLASSES: tuple[str, ...] = ("user", "page_faults", "memory_reclaim", "allocator_churn", "mmap_lock", "block_io", "dirty_throttling")
# The trainer's own host work ("user" running time outside GPU synchronisation), by the
# Python frames of its on-CPU samples (analyzers/causes/host.py): data loading in its own
# thread, or any other computation.
HOST_CLASSES: tuple[str, ...] = ("loading", "compute")
# A starved piece's running class: "" for pieces that were not running; a host class for
# the trainer's host-bound running time.
RUN_CLASS_DTYPE = pd.CategoricalDtype(("",) + RUN_CLASSES + HOST_CLASSES)

# Integer codes of the categorical vocabularies: hot paths compare codes, not strings.
STATE_CODE: dict[str, int] = {name: i for i, name in enumerate(STATES)}
FUTEX_CODE: dict[str, int] = {name: i for i, name in enumerate(FUTEX_CLASSES)}


def codes(values: pd.Series) -> np.ndarray:
    """The integer codes of a categorical column."""
    return values.cat.codes.to_numpy()
