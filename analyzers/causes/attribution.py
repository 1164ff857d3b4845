"""Why a thread was not doing useful work: the cause of each blocked interval, what a
futex wait was (a contended lock, the GIL, or a wait for something), what on-CPU samples
say about running time, and which threads churn memory mappings."""

from __future__ import annotations

import os
from functools import partial
from typing import Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.network import waits_on_network
from trainbpf.analyzers.causes.stack_reading import CLASS_CODE, stack_class_codes
from trainbpf.analyzers.intervals import (
    Span,
    as_int64,
    best_overlap,
    dense_rank,
    merge_intervals,
    pair_ids,
    run_parallel,
    stable_order,
)
from trainbpf.analyzers.vocab import (
    FUTEX_CLASS_DTYPE,
    FUTEX_CODE,
    RUN_CLASSES,
    STATE_CODE,
    STATE_DTYPE,
    codes,
)

# Evidence rows of the same thread that name a blocked interval's cause, strongest last
# (later ones overwrite): a row that overlaps the interval is direct kernel evidence.
EVIDENCE_KINDS: tuple[tuple[str, str], ...] = (
    ("mmap_lock", "mmap_lock"),
    ("dirty_pause", "dirty_throttling"),
    ("compaction", "memory_reclaim"),
    ("reclaim", "memory_reclaim"),
)
# Kernel-stack classes at switch-out that name a blocked state.
STACK_STATES = ("dirty_throttling", "memory_reclaim", "mmap_lock", "page_faults", "block_io", "network_io", "futex")

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
# What an address holds, from the data symbol the recorder found it in (futex_addr rows):
# CPython keeps the GIL in its runtime state; glibc's main_arena starts with the
# allocator's mutex.  Other arenas live in anonymous memory and go by the rules above.
NAMED_ADDRESS_CLASSES: tuple[tuple[str, str], ...] = (("gil", "_PyRuntime+"), ("lock", "main_arena+0x0 "))
# A thread churns mappings when it makes at least this many mm calls per second, or
# maps at least this many fresh bytes per second.
CHURN_MIN_CALLS_PER_S = 20.0
CHURN_MIN_BYTES_PER_S = 64 << 20

# Stack class code -> RUN_CLASSES code for on-CPU samples (anything else is user work).
_RUN_OF_STACK = np.array([RUN_CLASSES.index(c) if c in RUN_CLASSES else 0 for c in CLASS_CODE], dtype=np.int8)

FUTEX_COLUMNS = ("pid", "tid", "addr", "start_ns", "end_ns", "waker_tid", "n_waiters", "handoff", "cls")
SAMPLE_COLUMNS = ("tid", "ts_ns", "cpu", "cls")  # and pystack_id, host, host_frame where the oncpu rows have them
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
    slots: pd.DataFrame,
    frames: Mapping[str, pd.DataFrame],
    stacks: pd.DataFrame,
    *,
    lookback_ns: int = HANDOFF_LOOKBACK_NS,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """State slots (states.SLOT_COLUMNS) with their blocked parts renamed by cause, plus
    the blocked part's `futex_class`; and the classified futex waits.  `frames` maps kinds
    to trace frames (missing = none)."""
    state_codes = codes(slots["state"]).copy()
    switch_out, wake = slots["switch_out_ns"].to_numpy(), slots["wake_ns"].to_numpy()
    blocked = np.flatnonzero(wake > switch_out)  # the slots with a blocked part
    b = pd.DataFrame({"tid": slots["tid"].to_numpy()[blocked], "start_ns": switch_out[blocked], "end_ns": wake[blocked],
                      "waker_tid": slots["waker_tid"].to_numpy()[blocked]}, copy=False)
    code = state_codes[blocked]
    sched_d = code == STATE_CODE["uninterruptible"]

    def overlapping(kind: str) -> np.ndarray | None:
        """Per blocked interval, the `kind` row overlapping it most (-1: none); None without rows."""
        frame = frames.get(kind)
        return best_overlap(b, evidence_intervals(frame)) if frame is not None and len(frame) else None

    # Weakest first: block requests explain D-state waits, futex rows futex waits.
    block_rq = overlapping("block_rq")
    if block_rq is not None:
        code[(block_rq >= 0) & sched_d] = STATE_CODE["block_io"]
    futex = frames.get("futex", pd.DataFrame(columns=["ts_ns", "dur_ns", "tid"]))
    futex_iv = evidence_intervals(futex)
    futex_row = best_overlap(b, futex_iv)
    code[futex_row >= 0] = STATE_CODE["futex"]
    kcls = stack_class_codes(stacks, slots["kstack_id"].to_numpy()[blocked])
    for name in reversed(STACK_STATES):
        code[kcls == CLASS_CODE[name]] = STATE_CODE[name]
    # A poll/select/epoll wait is a network wait where the thread received on an IP socket then.
    poll = np.flatnonzero(kcls == CLASS_CODE["poll_wait"])
    on_net = waits_on_network(b["tid"].to_numpy()[poll], b["start_ns"].to_numpy()[poll], b["end_ns"].to_numpy()[poll],
                              frames.get("net_io"), frames.get("socket"))
    code[poll[on_net]] = STATE_CODE["network_io"]
    for kind, name in EVIDENCE_KINDS:
        hit = overlapping(kind)
        if hit is not None:
            code[hit >= 0] = STATE_CODE[name]
    state_codes[blocked] = code

    waits = classify_futex(futex, futex_iv, futex_row, b["waker_tid"].to_numpy(), stacks,
                           named=frames.get("futex_addr"), lookback_ns=lookback_ns)
    fclass = np.zeros(len(slots), dtype=np.int8)
    is_futex = code == STATE_CODE["futex"]
    row_cls = np.where(futex_row >= 0, codes(waits["cls"])[np.maximum(futex_row, 0)] if len(waits) else 0, 0)
    # Without a futex row, the user stack at switch-out may still show the GIL or a lock.
    ucls = stack_class_codes(stacks, slots["ustack_id"].to_numpy()[blocked])
    row_cls = np.where((row_cls == 0) & (ucls == CLASS_CODE["gil"]), FUTEX_CODE["gil"], row_cls)
    row_cls = np.where((row_cls == 0) & (ucls == CLASS_CODE["lock"]), FUTEX_CODE["lock"], row_cls)
    row_cls = np.where(row_cls == 0, FUTEX_CODE["wait"], row_cls)
    fclass[blocked[is_futex]] = row_cls[is_futex]

    out = slots.copy(deep=False)  # the other columns are shared, not copied
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
    named: pd.DataFrame | None = None,
    lookback_ns: int = HANDOFF_LOOKBACK_NS,
) -> pd.DataFrame:
    """Each futex wait: its waker (from the off-CPU interval it overlaps), how many
    threads wait on its address, whether its waker had just waited there (a handoff),
    and its class: "lock", "gil" or "wait" (waiting for something another thread does).
    `named` (futex_addr rows) says what some addresses hold; that beats the heuristics."""
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
    addr_id = pair_ids(pid, addr.view(np.int64))
    n_addr = int(addr_id.max()) + 1
    distinct = pd.unique(addr_id * (int(tid.max()) + 1) + tid) if len(tid) else np.zeros(0, np.int64)
    n_waiters = np.bincount(distinct // (int(tid.max()) + 1), minlength=n_addr)

    # Handoff: the waker's latest wait on the same address ended shortly before this one.
    rows = np.flatnonzero(waker >= 0)
    threads, thread_rank = dense_rank(np.concatenate([tid, waker[rows]]))
    key = addr_id * len(threads) + thread_rank[:n]  # (address, waiter), small integers
    found, prior = _latest_before(key, end, addr_id[rows] * len(threads) + thread_rank[n:], end[rows])
    reach = np.maximum(lookback_ns, end[rows] - start[rows])
    handoff = np.zeros(n, dtype=bool)
    handoff[rows] = found & (end[rows] - prior.astype(np.float64) <= reach)

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
    one = np.zeros(n_addr, dtype=np.int64)
    one[addr_id] = np.arange(n)  # a wait on each address
    by_name = named_address_classes(named, pid[one], addr[one])[addr_id]
    cls = np.where(by_name > 0, by_name, cls).astype(np.int8)
    return pd.DataFrame({
        "pid": pid, "tid": tid, "addr": addr, "start_ns": start, "end_ns": end, "waker_tid": waker,
        "n_waiters": n_waiters[addr_id].astype(np.int64), "handoff": handoff,
        "cls": pd.Categorical.from_codes(cls, dtype=FUTEX_CLASS_DTYPE),
    })[list(FUTEX_COLUMNS)]


def address_names(named: pd.DataFrame | None, pid: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """Per (pid, addr) pair, the name the recorder gave the address ("" if none): the
    latest description, as an exec gives a process's addresses new meanings."""
    out = np.full(len(pid), "", dtype=object)
    if named is None or not len(named) or not len(pid):
        return out
    n_pid, n_addr = as_int64(named["pid"]), pd.Series(named["addr"]).fillna(0).to_numpy(np.uint64)
    ids = pair_ids(np.concatenate([n_pid, as_int64(pd.Series(pid))]),
                   np.concatenate([n_addr, np.asarray(addr, dtype=np.uint64)]).view(np.int64))
    named_ids = ids[: len(named)]
    order = np.lexsort((as_int64(named["ts_ns"], 0), named_ids))  # by pair, the newest last
    newest = order[np.append(named_ids[order][1:] != named_ids[order][:-1], True)]
    latest = np.full(int(ids.max()) + 1, -1, dtype=np.int64)
    latest[named_ids[newest]] = newest  # one row per pair: no repeated indices
    row = latest[ids[len(named):]]
    names = named["name"].astype(object).fillna("").to_numpy()
    out[row >= 0] = names[row[row >= 0]]
    return out


def named_address_classes(named: pd.DataFrame | None, pid: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """Per (pid, addr), the FUTEX_CODE its name implies (NAMED_ADDRESS_CLASSES), 0 if none."""
    out = np.zeros(len(pid), dtype=np.int8)
    if named is None or not len(named):
        return out
    names = pd.Series(address_names(named, pid, addr), dtype=object).astype(str)
    for cls, prefix in NAMED_ADDRESS_CLASSES:
        out[names.str.startswith(prefix).to_numpy()] = FUTEX_CODE[cls]
    return out


def _latest_before(key: np.ndarray, at: np.ndarray, q_key: np.ndarray, q_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each query, whether a row with its key (small non-negative integers) is at or
    before its time, and the latest such row's `at`.  Only keys that both rows and
    queries have matter, split into one share per CPU (keys never cross shares)."""
    found = np.zeros(len(q_at), bool)
    prior = np.zeros(len(q_at), np.int64)
    keys, rank = dense_rank(np.concatenate([key, q_key]))
    r_rank, q_rank = rank[: len(key)], rank[len(key):]
    both = (np.bincount(r_rank, minlength=len(keys)) > 0) & (np.bincount(q_rank, minlength=len(keys)) > 0)
    shared = np.where(both, np.cumsum(both) - 1, -1)  # dense ids of the keys both have

    def share(part: int, parts: int) -> None:
        """Rows and queries sorted together by key, then time (rows first at equal times);
        the last row seen carried forward within each key."""
        rows = np.flatnonzero((shared[r_rank] >= 0) & (shared[r_rank] % parts == part))
        queries = np.flatnonzero((shared[q_rank] >= 0) & (shared[q_rank] % parts == part))
        n = len(rows)
        every_at = np.concatenate([at[rows], q_at[queries]])
        by_time = np.argsort(every_at, kind="stable")  # recorded times: nearly sorted already
        ids = shared[np.concatenate([r_rank[rows], q_rank[queries]])][by_time] // parts
        by_key = stable_order(ids)
        order, ids = by_time[by_key], ids[by_key]
        # A running maximum of row positions, each key offset above all before it: the
        # last row at or before each position within its key, or negative for none.
        offset = ids.astype(np.int64) * (len(order) + 1)
        last_row = np.maximum.accumulate(np.where(order < n, np.arange(len(order)), -1) + offset) - offset
        is_query = order >= n
        query = queries[order[is_query] - n]
        found[query] = last_row[is_query] >= 0
        prior[query] = every_at[order[np.maximum(last_row[is_query], 0)]]

    parts = os.cpu_count() or 1
    run_parallel([partial(share, part, parts) for part in range(parts)])  # each writes its own queries
    return found, prior


def sample_classes(oncpu: pd.DataFrame, stacks: pd.DataFrame) -> pd.DataFrame:
    """On-CPU samples with what their kernel stack says (RUN_CLASSES; "user" otherwise),
    their Python stack (-1: none) where `oncpu` has the column, and their host label and
    frame (host.host_labels) where it has those, sorted by time."""
    run_cls = _RUN_OF_STACK[stack_class_codes(stacks, oncpu["kstack_id"])]
    out = pd.DataFrame(
        {"tid": as_int64(oncpu["tid"]), "ts_ns": as_int64(oncpu["ts_ns"]), "cpu": as_int64(oncpu["cpu"]),
         "cls": pd.Categorical.from_codes(run_cls, categories=list(RUN_CLASSES))}
    )
    columns = list(SAMPLE_COLUMNS)
    if "pystack_id" in oncpu:
        out["pystack_id"] = oncpu["pystack_id"].to_numpy(dtype=np.int32, na_value=-1)
        columns.append("pystack_id")
    for name in ("host", "host_frame"):
        if name in oncpu:
            out[name] = np.asarray(oncpu[name])
            columns.append(name)
    return out.sort_values("ts_ns", kind="stable")[columns].reset_index(drop=True)


# Evidence rows whose intervals say exactly what a running thread was doing: reclaim and
# compaction run on the CPU inside the thread that needed the memory.
EXACT_RUN_KINDS: tuple[tuple[str, str], ...] = (("reclaim", "memory_reclaim"), ("compaction", "memory_reclaim"))


class RunSplit:
    """How a thread's running time divides between RUN_CLASSES.  Where evidence rows
    (`exact`: kind -> frame, EXACT_RUN_KINDS) cover part of a window, that part is their
    class exactly; the rest follows the thread's on-CPU samples outside those rows: the
    samples inside the window when there are some, the thread's overall mix otherwise."""

    def __init__(self, samples: pd.DataFrame, exact: Mapping[str, pd.DataFrame] | None = None):
        self._by_tid: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._exact: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        for kind, cls in EXACT_RUN_KINDS:
            frame = (exact or {}).get(kind)
            if frame is None or not len(frame):
                continue
            iv = evidence_intervals(frame)
            for tid, rows in iv.groupby("tid"):
                start, end = merge_intervals(rows["start_ns"].to_numpy(np.int64), rows["end_ns"].to_numpy(np.int64))
                if not len(start):  # only empty intervals
                    continue
                covered = np.concatenate([[0], np.cumsum(end - start)])
                self._exact.setdefault(int(tid), []).append((RUN_CLASSES.index(cls), start, end, covered))
        codes = samples["cls"].cat.codes.to_numpy()
        k = len(RUN_CLASSES)
        for tid, idx in samples.groupby("tid").indices.items():
            ts = samples["ts_ns"].to_numpy()[idx]
            outside = np.ones(len(idx), bool)
            for _, start, end, _ in self._exact.get(int(tid), ()):
                at = np.searchsorted(start, ts, side="right") - 1
                outside &= ~((at >= 0) & (ts < end[np.maximum(at, 0)]))
            ts, idx = ts[outside], idx[outside]
            onehot = np.zeros((len(idx) + 1, k), dtype=np.int64)
            onehot[np.arange(1, len(idx) + 1), codes[idx]] = 1
            self._by_tid[int(tid)] = (ts, np.cumsum(onehot, axis=0))

    @staticmethod
    def _covered_upto(t: np.ndarray, start: np.ndarray, end: np.ndarray, covered: np.ndarray) -> np.ndarray:
        """Length of the (sorted, disjoint) intervals before each time `t`."""
        at = np.searchsorted(start, t, side="right") - 1
        inside = np.clip(t - start[np.maximum(at, 0)], 0, (end - start)[np.maximum(at, 0)])
        return np.where(at >= 0, covered[np.maximum(at, 0)] + inside, 0)

    def fractions(self, tid: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(len(a), len(RUN_CLASSES)) fractions of running time per class in each [a, b)."""
        k = len(RUN_CLASSES)
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        out = np.zeros((len(a), k))
        out[:, 0] = 1.0
        exact = np.zeros((len(a), k))
        for cls, start, end, covered in self._exact.get(tid, ()):
            exact[:, cls] += self._covered_upto(b, start, end, covered) - self._covered_upto(a, start, end, covered)
        exact_share = exact / np.maximum(b - a, 1)[:, None]
        exact_share /= np.maximum(exact_share.sum(axis=1, keepdims=True), 1.0)  # kinds may overlap
        known = exact_share.sum(axis=1)
        if tid in self._by_tid:
            ts, cum = self._by_tid[tid]
            counts = cum[np.searchsorted(ts, b, side="left")] - cum[np.searchsorted(ts, a, side="left")]
            total = counts.sum(axis=1, keepdims=True)
            overall = cum[-1] / max(1, cum[-1].sum())
            if cum[-1].sum():
                out = np.where(total > 0, counts / np.maximum(total, 1), overall[None, :])
        return exact_share + out * (1.0 - known)[:, None]


# The madvise advice that gives memory back (the pages are dropped, and fault in afresh
# when touched again): MADV_DONTNEED, MADV_FREE, MADV_REMOVE and MADV_DONTNEED_LOCKED.
# Any other (MADV_HUGEPAGE, MADV_WILLNEED, MADV_NOHUGEPAGE, ...) keeps the memory.
MADV_GIVE_BACK = (4, 8, 9, 24)


def churn_threads(mm_syscall: pd.DataFrame, faults: pd.DataFrame, span: Span,
                  freed_by_others: pd.Series | None = None) -> pd.DataFrame:
    """Per thread: mmap/munmap/brk/madvise/mremap rates and sizes and page-fault rates;
    `churning` when calls are frequent and fresh mappings account for the faults.  Only
    munmap and the madvise that drops pages (MADV_GIVE_BACK) count as memory given back,
    and (`freed_by_others`: bytes per mapping tid) its mappings another thread unmapped."""
    seconds = max(span.seconds, 1e-9)
    lo, hi = span.start_ns, span.end_ns

    def in_span(frame: pd.DataFrame) -> np.ndarray:
        ts = as_int64(frame["ts_ns"])
        return (ts >= lo) & (ts < hi)

    mm = mm_syscall[in_span(mm_syscall)] if len(mm_syscall) else mm_syscall
    calls = pd.DataFrame({"tid": as_int64(mm["tid"]), "size": np.maximum(as_int64(mm["length"], 0), 0)})
    name, names = pd.factorize(mm["syscall"])  # a few syscall names, decoded once each (-1: null)

    def named(*syscalls: str) -> np.ndarray:
        return np.append(np.isin(np.asarray(names, dtype=object), syscalls), False)[name]

    maps = named("mmap", "brk", "mremap")
    advice = as_int64(mm["flags"], -1)
    unmaps = named("munmap") | (named("madvise") & np.isin(advice, MADV_GIVE_BACK))
    per = pd.DataFrame(
        {"calls": calls.groupby("tid").size(),
         "map_bytes": calls[maps].groupby("tid")["size"].sum(),
         "unmap_bytes": calls[unmaps].groupby("tid")["size"].sum(),
         "median_size": calls.groupby("tid")["size"].median()}
    )
    fl = faults[in_span(faults)] if len(faults) else faults
    fault_counts = pd.Series(np.maximum(as_int64(fl["faults"], 0), 0), index=as_int64(fl["tid"])).groupby(level=0).sum()
    per = per.reindex(per.index.union(fault_counts.index)).fillna(0)
    per["faults"] = fault_counts.reindex(per.index).fillna(0)
    per["calls_per_s"] = per["calls"] / seconds
    per["faults_per_s"] = per["faults"] / seconds
    # Churn: faults "on freshly mapped memory" (the bytes mapped cover a good part of
    # the pages faulted in, 4 KiB each), memory given back rather than kept (unmapped or
    # madvised away), and mappings that come and go often or in bulk.
    fresh = (per["map_bytes"] + per["unmap_bytes"]) / 4096.0 >= 0.25 * per["faults"]
    others = freed_by_others.reindex(per.index).fillna(0) if freed_by_others is not None else 0
    given_back = per["unmap_bytes"] + others >= 0.5 * per["map_bytes"]
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

