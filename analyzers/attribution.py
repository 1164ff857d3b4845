"""Why a thread was not doing useful work: the cause of each blocked interval, what a
futex wait was (a contended lock, the GIL, or a wait for something), what on-CPU samples
say about running time, and which threads churn memory mappings."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.categories import FUTEX_CLASS_DTYPE, FUTEX_CODE, RUN_CLASSES, STATE_CODE, STATE_DTYPE, codes
from trainbpf.analyzers.intervals import Span, as_int64, best_overlap
from trainbpf.analyzers.stacks import CLASS_CODE, stack_class_codes

# Evidence rows of the same thread that name a blocked interval's cause, strongest last
# (later ones overwrite): a row that overlaps the interval is direct kernel evidence.
EVIDENCE_KINDS: tuple[tuple[str, str], ...] = (
    ("mmap_lock", "mmap_lock"),
    ("dirty_pause", "dirty_throttling"),
    ("compaction", "memory_reclaim"),
    ("reclaim", "memory_reclaim"),
)
# Kernel-stack classes at switch-out that name a blocked state.
STACK_STATES = ("dirty_throttling", "memory_reclaim", "mmap_lock", "page_faults", "block_io", "futex")

# A futex address is a contended lock when several threads wait on it and, for at least
# this share of its woken waits, the waker had itself waited on it shortly before
# (the lock was handed over), looking back at least HANDOFF_LOOKBACK_NS.
LOCK_MIN_WAITERS = 2
LOCK_MIN_HANDOFF_SHARE = 0.25
HANDOFF_LOOKBACK_NS = 50_000_000
# CPython waits for the GIL in timed 5 ms slices (sys.getswitchinterval()): many
# un-woken waits of about that length on one shared address are the GIL.
GIL_SLICE_NS = (4_000_000, 6_500_000)
GIL_MIN_TIMED_SHARE = 0.2
# A thread churns mappings when it makes at least this many mm calls per second, or
# maps at least this many fresh bytes per second.
CHURN_MIN_CALLS_PER_S = 20.0
CHURN_MIN_BYTES_PER_S = 64 << 20

_BLOCKED_FROM_SCHED = np.array([STATE_CODE["sleep"], STATE_CODE["uninterruptible"], STATE_CODE["other"]])
# Stack class code -> RUN_CLASSES code for on-CPU samples (anything else is user work).
_RUN_OF_STACK = np.array([RUN_CLASSES.index(c) if c in RUN_CLASSES else 0 for c in CLASS_CODE], dtype=np.int8)

FUTEX_COLUMNS = ("pid", "tid", "addr", "start_ns", "end_ns", "waker_tid", "n_waiters", "handoff", "cls")
SAMPLE_COLUMNS = ("tid", "ts_ns", "cpu", "cls")
CHURN_COLUMNS = (
    "tid", "calls", "calls_per_s", "map_bytes", "unmap_bytes", "median_size",
    "faults", "faults_per_s", "churning",
)


def evidence_intervals(frame: pd.DataFrame) -> pd.DataFrame:
    """(tid, start_ns, end_ns) of rows that have a duration."""
    start = as_int64(frame["ts_ns"])
    return pd.DataFrame(
        {"tid": as_int64(frame["tid"]), "start_ns": start,
         "end_ns": start + np.maximum(as_int64(frame["dur_ns"], 0), 0)}
    )


def attribute_states(
    states: pd.DataFrame,
    frames: Mapping[str, pd.DataFrame],
    stacks: pd.DataFrame,
    *,
    lookback_ns: int = HANDOFF_LOOKBACK_NS,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Blocked intervals renamed by their cause, plus a `futex_class` column; and the
    classified futex waits.  `frames` maps kinds to trace frames (missing = none)."""
    state_codes = codes(states["state"]).copy()
    blocked = np.flatnonzero(np.isin(state_codes, _BLOCKED_FROM_SCHED))
    b = states.iloc[blocked][["tid", "start_ns", "end_ns", "waker_tid"]]
    code = state_codes[blocked]
    sched_d = code == STATE_CODE["uninterruptible"]

    def empty(kind: str) -> pd.DataFrame:
        return frames.get(kind, pd.DataFrame(columns=["ts_ns", "dur_ns", "tid"]))

    # Weakest first: block requests explain D-state waits, futex rows futex waits.
    block_rq = best_overlap(b, evidence_intervals(empty("block_rq")))
    code[(block_rq >= 0) & sched_d] = STATE_CODE["block_io"]
    futex = empty("futex")
    futex_iv = evidence_intervals(futex)
    futex_row = best_overlap(b, futex_iv)
    code[futex_row >= 0] = STATE_CODE["futex"]
    kcls = stack_class_codes(stacks, states["kstack_id"].to_numpy()[blocked])
    for name in reversed(STACK_STATES):
        code[kcls == CLASS_CODE[name]] = STATE_CODE[name]
    for kind, name in EVIDENCE_KINDS:
        hit = best_overlap(b, evidence_intervals(empty(kind)))
        code[hit >= 0] = STATE_CODE[name]
    state_codes[blocked] = code

    waits = classify_futex(futex, futex_iv, futex_row, b["waker_tid"].to_numpy(), stacks, lookback_ns=lookback_ns)
    fclass = np.zeros(len(states), dtype=np.int8)
    is_futex = code == STATE_CODE["futex"]
    row_cls = np.where(futex_row >= 0, codes(waits["cls"])[np.maximum(futex_row, 0)] if len(waits) else 0, 0)
    # Without a futex row, the user stack at switch-out may still show the GIL or a lock.
    ucls = stack_class_codes(stacks, states["ustack_id"].to_numpy()[blocked])
    row_cls = np.where((row_cls == 0) & (ucls == CLASS_CODE["gil"]), FUTEX_CODE["gil"], row_cls)
    row_cls = np.where((row_cls == 0) & (ucls == CLASS_CODE["lock"]), FUTEX_CODE["lock"], row_cls)
    row_cls = np.where(row_cls == 0, FUTEX_CODE["wait"], row_cls)
    fclass[blocked[is_futex]] = row_cls[is_futex]

    out = states.copy(deep=False)  # the other columns are shared, not copied
    out["state"] = pd.Categorical.from_codes(state_codes, dtype=STATE_DTYPE)
    out["futex_class"] = pd.Categorical.from_codes(fclass, dtype=FUTEX_CLASS_DTYPE)
    return out, waits


def classify_futex(
    futex: pd.DataFrame,
    futex_iv: pd.DataFrame,
    matched_row: np.ndarray,
    matched_waker: np.ndarray,
    stacks: pd.DataFrame,
    *,
    lookback_ns: int = HANDOFF_LOOKBACK_NS,
) -> pd.DataFrame:
    """Each futex wait: its waker (from the off-CPU interval it overlaps), how many
    threads wait on its address, whether its waker had just waited there (a handoff),
    and its class: "lock", "gil" or "wait" (waiting for something another thread does)."""
    n = len(futex)
    if not n:
        return pd.DataFrame(
            {"pid": np.zeros(0, np.int64), "tid": np.zeros(0, np.int64), "addr": np.zeros(0, np.uint64),
             "start_ns": np.zeros(0, np.int64), "end_ns": np.zeros(0, np.int64),
             "waker_tid": np.zeros(0, np.int64), "n_waiters": np.zeros(0, np.int64),
             "handoff": np.zeros(0, bool), "cls": pd.Categorical([], dtype=FUTEX_CLASS_DTYPE)}
        )
    waker = np.full(n, -1, dtype=np.int64)
    ok = matched_row >= 0
    waker[matched_row[ok]] = matched_waker[ok]
    addr = pd.Series(futex["addr"]).fillna(0).to_numpy(np.uint64)
    pid = as_int64(futex["pid"])
    tid = futex_iv["tid"].to_numpy(np.int64)
    start = futex_iv["start_ns"].to_numpy(np.int64)
    end = futex_iv["end_ns"].to_numpy(np.int64)
    # One integer per (process, address): futex addresses are per-process virtual ones.
    addr_id = pd.MultiIndex.from_arrays([pid, addr.view(np.int64)]).factorize()[0].astype(np.int64)
    n_addr = int(addr_id.max()) + 1
    distinct = pd.unique(addr_id * (int(tid.max()) + 1) + tid) if len(tid) else np.zeros(0, np.int64)
    n_waiters = np.bincount(distinct // (int(tid.max()) + 1), minlength=n_addr)

    # Handoff: the waker's latest wait on the same address ended shortly before this one.
    stride = int(max(tid.max(), waker.max(), 0)) + 1
    woken_rows = np.flatnonzero(waker >= 0)
    left = pd.DataFrame({"key": addr_id[woken_rows] * stride + waker[woken_rows], "end_ns": end[woken_rows],
                         "row": woken_rows}).sort_values("end_ns", kind="stable")
    right = pd.DataFrame({"key": addr_id * stride + tid, "prior_end": end}).sort_values("prior_end", kind="stable")
    m = pd.merge_asof(left, right, left_on="end_ns", right_on="prior_end", by="key", direction="backward")
    rows = m["row"].to_numpy()
    prior = m["prior_end"].to_numpy(dtype=np.float64, na_value=np.nan)
    reach = np.maximum(lookback_ns, end[rows] - start[rows])
    handoff = np.zeros(n, dtype=bool)
    handoff[rows] = ~np.isnan(prior) & (end[rows] - np.nan_to_num(prior, nan=-1e30) <= reach)

    ustack = stack_class_codes(stacks, futex["ustack_id"] if "ustack_id" in futex else np.full(n, -1))
    gil_stack = ustack == CLASS_CODE["gil"]
    dur = end - start
    timed = (waker < 0) & (dur >= GIL_SLICE_NS[0]) & (dur <= GIL_SLICE_NS[1])

    def per_addr(flags: np.ndarray) -> np.ndarray:
        return np.bincount(addr_id, weights=flags, minlength=n_addr)

    waits = per_addr(np.ones(n))
    woken = per_addr(waker >= 0)
    shared = n_waiters >= LOCK_MIN_WAITERS
    handoff_share = per_addr(handoff) / np.maximum(woken, 1)
    addr_lock = shared & ((handoff_share >= LOCK_MIN_HANDOFF_SHARE) | (per_addr(ustack == CLASS_CODE["lock"]) > 0))
    addr_gil = (per_addr(gil_stack) > 0) | (shared & (per_addr(timed) / waits >= GIL_MIN_TIMED_SHARE))
    addr_cls = np.full(n_addr, FUTEX_CODE["wait"], dtype=np.int8)
    addr_cls[addr_lock] = FUTEX_CODE["lock"]
    addr_cls[addr_gil] = FUTEX_CODE["gil"]
    cls = np.where(gil_stack, FUTEX_CODE["gil"], addr_cls[addr_id]).astype(np.int8)
    return pd.DataFrame({
        "pid": pid, "tid": tid, "addr": addr, "start_ns": start, "end_ns": end, "waker_tid": waker,
        "n_waiters": n_waiters[addr_id].astype(np.int64), "handoff": handoff,
        "cls": pd.Categorical.from_codes(cls, dtype=FUTEX_CLASS_DTYPE),
    })[list(FUTEX_COLUMNS)]


def sample_classes(oncpu: pd.DataFrame, stacks: pd.DataFrame) -> pd.DataFrame:
    """On-CPU samples with what their kernel stack says (RUN_CLASSES; "user" otherwise),
    sorted by time."""
    run_cls = _RUN_OF_STACK[stack_class_codes(stacks, oncpu["kstack_id"])]
    out = pd.DataFrame(
        {"tid": as_int64(oncpu["tid"]), "ts_ns": as_int64(oncpu["ts_ns"]), "cpu": as_int64(oncpu["cpu"]),
         "cls": pd.Categorical.from_codes(run_cls, categories=list(RUN_CLASSES))}
    )
    return out.sort_values("ts_ns", kind="stable")[list(SAMPLE_COLUMNS)].reset_index(drop=True)


class RunSplit:
    """How a thread's running time divides between RUN_CLASSES, from its on-CPU samples:
    the samples inside a window when there are some, the thread's overall mix otherwise."""

    def __init__(self, samples: pd.DataFrame):
        self._by_tid: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        codes = samples["cls"].cat.codes.to_numpy()
        k = len(RUN_CLASSES)
        for tid, idx in samples.groupby("tid").indices.items():
            ts = samples["ts_ns"].to_numpy()[idx]
            onehot = np.zeros((len(idx) + 1, k), dtype=np.int64)
            onehot[np.arange(1, len(idx) + 1), codes[idx]] = 1
            self._by_tid[int(tid)] = (ts, np.cumsum(onehot, axis=0))

    def fractions(self, tid: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(len(a), len(RUN_CLASSES)) fractions of running time per class in each [a, b)."""
        k = len(RUN_CLASSES)
        out = np.zeros((len(a), k))
        out[:, 0] = 1.0
        if tid not in self._by_tid:
            return out
        ts, cum = self._by_tid[tid]
        counts = cum[np.searchsorted(ts, b, side="left")] - cum[np.searchsorted(ts, a, side="left")]
        total = counts.sum(axis=1, keepdims=True)
        overall = cum[-1] / max(1, cum[-1].sum())
        return np.where(total > 0, counts / np.maximum(total, 1), overall[None, :])


def churn_threads(mm_syscall: pd.DataFrame, faults: pd.DataFrame, span: Span) -> pd.DataFrame:
    """Per thread: mmap/munmap/brk/madvise/mremap rates and sizes and page-fault rates;
    `churning` when calls are frequent and fresh mappings account for the faults."""
    seconds = max(span.seconds, 1e-9)
    lo, hi = span.start_ns, span.end_ns

    def in_span(frame: pd.DataFrame) -> np.ndarray:
        ts = as_int64(frame["ts_ns"])
        return (ts >= lo) & (ts < hi)

    mm = mm_syscall[in_span(mm_syscall)] if len(mm_syscall) else mm_syscall
    calls = pd.DataFrame(
        {"tid": as_int64(mm["tid"]), "name": mm["name"].fillna("").astype(str).to_numpy(dtype=object),
         "size": np.maximum(as_int64(mm["size"], 0), 0)}
    )
    maps = calls["name"].isin(["mmap", "brk", "mremap"])
    unmaps = calls["name"].isin(["munmap", "madvise"])
    per = pd.DataFrame(
        {"calls": calls.groupby("tid").size(),
         "map_bytes": calls[maps].groupby("tid")["size"].sum(),
         "unmap_bytes": calls[unmaps].groupby("tid")["size"].sum(),
         "median_size": calls.groupby("tid")["size"].median()}
    )
    fl = faults[in_span(faults)] if len(faults) else faults
    fault_counts = pd.Series(np.maximum(as_int64(fl["count"], 0), 0), index=as_int64(fl["tid"])).groupby(level=0).sum()
    per = per.reindex(per.index.union(fault_counts.index)).fillna(0)
    per["faults"] = fault_counts.reindex(per.index).fillna(0)
    per["calls_per_s"] = per["calls"] / seconds
    per["faults_per_s"] = per["faults"] / seconds
    # Churn: faults "on freshly mapped memory" (the bytes mapped cover a good part of
    # the pages faulted in, 4 KiB each), memory given back rather than kept (unmapped or
    # madvised away), and mappings that come and go often or in bulk.
    fresh = (per["map_bytes"] + per["unmap_bytes"]) / 4096.0 >= 0.25 * per["faults"]
    given_back = per["unmap_bytes"] >= 0.5 * per["map_bytes"]
    often = (per["calls_per_s"] >= CHURN_MIN_CALLS_PER_S) | (per["map_bytes"] / seconds >= CHURN_MIN_BYTES_PER_S)
    per["churning"] = fresh & given_back & often & (per["faults"] > 0)
    per = per.reset_index(names="tid")
    out = pd.DataFrame(
        {"tid": per["tid"].to_numpy(np.int64), "calls": per["calls"].to_numpy(np.int64),
         "calls_per_s": per["calls_per_s"].to_numpy(np.float64),
         "map_bytes": per["map_bytes"].to_numpy(np.int64), "unmap_bytes": per["unmap_bytes"].to_numpy(np.int64),
         "median_size": per["median_size"].to_numpy(np.float64), "faults": per["faults"].to_numpy(np.int64),
         "faults_per_s": per["faults_per_s"].to_numpy(np.float64), "churning": per["churning"].to_numpy(bool)}
    )
    return out[list(CHURN_COLUMNS)]

