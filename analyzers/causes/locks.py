"""Which lock a lock finding's waits were on, and what its holders were doing.

A lock is named from what the trace knows for certain, strongest first:
- glibc's malloc arena: the busiest address is the first word of libc's `main_arena`
  (the recorder names it through libc's symbols or its debug file), or the waiters'
  native stack runs through glibc's allocator (another arena lives in anonymous memory);
- a Python lock: the waiters' stack takes it through the interpreter's lock
  (PyThread_acquire_lock) or their leaf Python frame is a threading wait;
- else the mapping the address lies in, and the address.
The holders are the threads whose release ended the trainer's waits (the wakers): each
is named with the Python frame it was in at those wake-ups (offcpu `peer_pystack_id`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.stack_reading import LIBRARY_FILE, PYTHON_FRAME, python_frame, stack_frames

# A native frame inside glibc's allocator, as the recorder writes it ("malloc [libc.so.6]").
ARENA_FRAME = re.compile(r"^(?:__libc_)?(?:malloc|free|calloc|realloc|_int_malloc|_int_free\w*|_int_realloc"
                         r"|arena_get2|malloc_consolidate|sysmalloc|systrim|tcache_init\w*) \[libc")
ARENA_SYMBOL = "main_arena+"
# The interpreter's own lock routines: a threading.Lock, RLock or Condition underneath.
PYTHON_LOCK_NATIVE = re.compile(r"PyThread_acquire_lock|lock_PyThread_acquire_lock|acquire_timed|rlock_acquire")
# A leaf Python frame that waits on a threading primitive.
PYTHON_LOCK_FRAME = re.compile(r"^(?:Condition\.wait|Semaphore\.acquire|BoundedSemaphore\.acquire|Event\.wait"
                               r"|Barrier\.wait|Condition\._acquire_restore)\b")
# Holders a finding's names spell out.
NAMED_HOLDERS = 3
# Python frames a holder carries, leaf first.
HOLDER_FRAMES = 4


def lock_identity(address: str, address_name: str, user_stack: str, holders: list[dict[str, Any]]) -> dict[str, Any]:
    """The lock of a lock finding and its case (categories.py lock_contention's `cases`):
    {"lock": {"kind", "name"}, "case", "names": {"lock", "holders"}}; no case where the
    lock is only known by its mapping (the general advice stands).  `user_stack`: the
    waiters' top stack (native frames, then Python ones, ";"-joined)."""
    frames = [f for f in user_stack.split(";") if f]
    native = [f for f in frames if not PYTHON_FRAME.match(f)]
    python = [f for f in frames if PYTHON_FRAME.match(f)]
    named_holders = holder_names(holders)
    if address_name.startswith(ARENA_SYMBOL) or (any(ARENA_FRAME.match(f) for f in native)
                                                 and address_name in ("", "[heap]", "[anon]")):
        where = address_name if address_name.startswith(ARENA_SYMBOL) else f"an arena at {address}"
        return {"lock": {"kind": "malloc_arena", "name": f"glibc malloc arena ({where})"}, "case": "malloc_arena",
                "names": {"lock": where, "holders": named_holders}}
    if any(PYTHON_LOCK_NATIVE.search(f) for f in native) or (python and PYTHON_LOCK_FRAME.match(python[0])):
        lock = f"Python lock taken at {_taken_at(python)}" if python else "Python lock (no Python frame recorded)"
        return {"lock": {"kind": "python_lock", "name": lock}, "case": "python_lock",
                "names": {"lock": lock, "holders": named_holders}}
    lock = f"lock at {address}" if address else "lock (no futex wait recorded)"
    lock += f" in {address_name}" if address_name else ""
    return {"lock": {"kind": "mapping", "name": lock}}


def _taken_at(python: list[str]) -> str:
    """The program's own frame that took the lock ("train.py:42 step"), with the
    threading frame it waited in where that is the leaf."""
    parsed = [python_frame(f) for f in python]
    own = next((f for f in parsed if not LIBRARY_FILE.search(str(f["file"]))), parsed[0])
    text = frame_text(own)
    return text if own is parsed[0] else f"{text} (in {parsed[0]['function']})"


def frame_text(frame: dict[str, Any]) -> str:
    """A Python frame as "train.py:42 step"."""
    return f"{str(frame['file']).rsplit('/', 1)[-1]}:{frame['line']} {frame['function']}"


def holder_names(holders: list[dict[str, Any]]) -> str:
    """The holders for a sentence: "churn_0 (123) in malloc_arena.py:50 churn_forever, ..."."""
    if not holders:
        return "threads the trace does not name"
    parts = [f"{h['comm'] or '?'} ({h['tid']})" + (f" in {h['function']}" if h.get("function") else "")
             for h in holders[:NAMED_HOLDERS]]
    more = len(holders) - NAMED_HOLDERS
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def holder_frames(pystacks: pd.DataFrame, waker: np.ndarray, peer_pystack: np.ndarray | None,
                  weights: np.ndarray, tid: int) -> dict[str, Any]:
    """Holder `tid`'s Python frames at the wake-ups it made (the Python stack that held
    the most waiting time, `weights`): {"python": frames leaf first, "function": the
    program's own frame, else the leaf}; {} where the trace has none."""
    if peer_pystack is None or not len(pystacks):
        return {}
    mine = (waker == tid) & (peer_pystack >= 0)
    if not mine.any():
        return {}
    by_stack = pd.Series(weights[mine]).groupby(peer_pystack[mine]).sum()
    frames = [python_frame(f) for f in stack_frames(pystacks, int(by_stack.idxmax()))[:HOLDER_FRAMES]]
    if not frames:
        return {}
    own = next((f for f in frames if not LIBRARY_FILE.search(str(f["file"]))), frames[0])
    return {"python": frames, "function": frame_text(own)}
