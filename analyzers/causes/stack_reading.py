"""What a symbolised stack says a thread was doing.

``stack`` rows carry frames leaf first, joined by ";".  Each distinct native stack is
classified once by substring patterns (a few thousand stacks at most), then stack ids are
mapped to classes with array lookups.  Python stacks (space "python") are never
classified: a Python function named `free_pages` or `take_gil_snapshot` says nothing
about the allocator or the GIL, so classes come from native frames alone.  They are kept
in a table of their own (`python_stacks`) and joined to a native user stack only for
display (`merge_frames`): native leaf -> Python frames -> native root.
"""

from __future__ import annotations

import re

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
    # A wait on a socket: a receive, an accept, a connect, a full send buffer.
    ("network_io", r"sk_wait_data|tcp_recvmsg|udp_recvmsg|inet_csk_accept|inet_csk_wait_for_connect"
                   r"|__inet_stream_connect|inet_wait_for_connect|__skb_wait_for_more_packets"
                   r"|unix_stream_read_generic|unix_stream_data_wait|sock_recvmsg|tcp_sendmsg"
                   r"|sk_stream_wait_memory|unix_stream_sendmsg|sock_sendmsg"),
    # poll/select/epoll: on sockets or not, the stack cannot tell; the analysis decides
    # from the thread's socket traffic around the wait.
    ("poll_wait", r"do_sys_poll|do_select|ep_poll|do_epoll_wait"),
    ("futex", r"futex_wait"),
)

# User stack classes: the GIL, a lock routine, the allocator (for lock evidence), and a
# GPU synchronisation or blocking copy inside the CUDA driver (what a spinning wait for
# the GPU shows on the CPU: GPU-bound time, not host work).
USER_PATTERNS: tuple[tuple[str, str], ...] = (
    ("gil", r"take_gil|PyEval_AcquireThread|PyEval_RestoreThread|PyEval_AcquireLock|PyGILState_Ensure"),
    ("lock", r"pthread_mutex_lock|__lll_lock_wait|pthread_rwlock_|pthread_spin_lock|lll_lock|__pthread_mutex_cond_lock"),
    ("gpu_sync", r"libcuda\.so|(?:cu|cuda)(?:Ctx|Device|Stream|Event)Synchronize|cuMemcpy(?:DtoH|HtoD)?(?:_v2)?(?:;|$)"
                 r"|cudaMemcpy(?:;|$)"),
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
    """One row per native stack id: whether it is a kernel stack, its class
    (STACK_CLASSES), whether it runs through the allocator, and its frames.  Python
    stacks are left out (python_stacks has them)."""
    stack = stack[~is_python(stack)]
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


def stack_frames(stacks: pd.DataFrame, stack_id: int) -> list[str]:
    """A stack's frames, leaf first; [] for an unknown id."""
    row = stacks.loc[stacks["stack_id"] == stack_id, "frames"]
    return str(row.iloc[0]).split(";") if len(row) and str(row.iloc[0]) else []


def stack_excerpt(stacks: pd.DataFrame, stack_id: int, frames: int = 6) -> str:
    """The leaf-most frames of a stack, for evidence."""
    return ";".join(stack_frames(stacks, stack_id)[:frames])


# -- Python stacks -------------------------------------------------------------------

PYTHON_SPACE = "python"
PYTHON_STACK_COLUMNS = ("stack_id", "pid", "frames")
# A native frame that runs Python code: where a native stack enters the interpreter.
INTERPRETER_FRAME = re.compile(r"_PyEval_EvalFrame|PyEval_EvalFrame|PyEval_EvalCode")
# Files of the standard library, of installed packages and of frozen modules: frames
# there say how a thread waited or worked, not where in the program.
LIBRARY_FILE = re.compile(r"/lib/python\d[\d.]*/|/site-packages/|/dist-packages/|^<frozen ")
# One recorded Python frame: "qualname (file:line)" (docs/trace-format.md).
PYTHON_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>.*):(?P<line>-?\d+)\)$")


def is_python(stack: pd.DataFrame) -> np.ndarray:
    """Which `stack` rows (trace view) are Python stacks."""
    return stack["space"].fillna("").astype(str).to_numpy(dtype=object) == PYTHON_SPACE


def python_stacks(stack: pd.DataFrame) -> pd.DataFrame:
    """The Python stacks of a trace's `stack` rows (PYTHON_STACK_COLUMNS), frames leaf
    first as recorded; empty for a trace without any (version 1, or the walk off)."""
    rows = stack[is_python(stack)]
    return pd.DataFrame({
        "stack_id": as_int64(rows["stack_id"]),
        "pid": as_int64(rows["pid"]),
        "frames": rows["frames"].fillna("").astype(str).to_numpy(dtype=object),
    }).drop_duplicates("stack_id", keep="last").reset_index(drop=True)


def python_frame(text: str) -> dict[str, object]:
    """A recorded Python frame as {"function", "file", "line"}; text that is not in the
    recorded form is the function, with no file and line 0."""
    m = PYTHON_FRAME.match(text)
    if m is None:
        return {"function": text, "file": "", "line": 0}
    return {"function": m["function"], "file": m["file"], "line": int(m["line"])}


def merge_frames(native: list[str], python: list[str]) -> list[str]:
    """One stack, leaf first: the native frames up to the first interpreter frame, the
    Python frames, then the native frames from that interpreter frame on to the root.  A
    native stack that never enters the interpreter (walk cut short) is all leaf side: the
    Python frames follow it.  Without Python frames, the native stack as it is."""
    if not python:
        return list(native)
    at = _interpreter_at(native)
    return native[:at] + python + native[at:]


def _interpreter_at(native: list[str]) -> int:
    """The position of a native stack's first interpreter frame (its length if none)."""
    return next((i for i, f in enumerate(native) if INTERPRETER_FRAME.search(f)), len(native))


def merged_excerpt(native: pd.DataFrame, python: pd.DataFrame, ustack_id: int, pystack_id: int,
                   frames: int = 6, python_frames: int = 4) -> str:
    """A user stack's leaf-most native frames up to the interpreter (at most `frames`),
    then its leaf-most Python frames (at most `python_frames`), for evidence.  Without a
    Python stack, stack_excerpt's text."""
    user = stack_frames(native, ustack_id)
    py = stack_frames(python, pystack_id) if pystack_id >= 0 else []
    if not py:
        return ";".join(user[:frames])
    return ";".join(user[:min(_interpreter_at(user), frames)] + py[:python_frames])
