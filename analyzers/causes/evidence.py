"""What findings quote as evidence: one builder per finding category (the registry in
analyzers/causes/categories.py names each category's), each `(ctx, pieces, roots) -> dict` of
plain numbers, lists and names read from the trace frames (under their meaningful column
names, trainbpf.trace.schema.KIND_NAMES) and the analyzer tables, over the analysed window."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.attribution import address_names
from trainbpf.analyzers.causes.freed_late import freed_late
from trainbpf.analyzers.causes.huge_pages import PAGE_COLUMNS, page_evidence
from trainbpf.analyzers.causes.io_culprits import io_culprits
from trainbpf.analyzers.causes.locks import holder_frames, lock_identity
from trainbpf.analyzers.causes.numa import REMOTE_MIN_FRACTION, copy_case
from trainbpf.analyzers.causes.page_cache import reclaim_culprits
from trainbpf.analyzers.causes.stack_reading import (
    PYTHON_STACK_COLUMNS,
    merged_excerpt,
    stack_excerpt,
)
from trainbpf.analyzers.causes.tlb import CALL_COLUMNS, CHARGE_COLUMNS, shootdown_evidence
from trainbpf.analyzers.intervals import NS_PER_S, Span, as_int64, pair_ids, thread_ranges
from trainbpf.analyzers.threads.states import PART_CODES, SLOT_EDGES, clipped_lengths
from trainbpf.analyzers.vocab import FUTEX_CODE, STATE_CODE, codes

# Threads a finding names at most.
MAX_THREADS = 5


@dataclass
class EvidenceContext:
    """What findings quote as evidence: trace frames and analyzer tables, over `window`."""

    window: Span
    threads: pd.DataFrame
    slots: pd.DataFrame  # every thread's attributed state slots
    trainer_states: pd.DataFrame
    futex_waits: pd.DataFrame
    stacks: pd.DataFrame
    frames: Mapping[str, pd.DataFrame]
    churn: pd.DataFrame
    placement: pd.DataFrame
    memory_nodes: dict[int, int] = field(default_factory=dict)
    gpu_node: int | None = None
    copies: dict[str, Any] | None = None  # numa.copy_sources: where the bytes copied to the GPU came from
    topology: dict[str, Any] = field(default_factory=dict)
    # The trace's Python stacks (stacks.python_stacks; empty: none) and the on-CPU samples
    # (attribution.SAMPLE_COLUMNS) their ids are looked up for.
    pystacks: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(PYTHON_STACK_COLUMNS)))
    samples: pd.DataFrame | None = None
    # Each process's faults per MiB newly mapped (huge_pages.process_pages) and the THP state.
    pages: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(PAGE_COLUMNS)))
    thp: dict[str, Any] = field(default_factory=dict)
    shootdowns: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(CHARGE_COLUMNS)))
    mm_calls: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(CALL_COLUMNS)))
    lifetimes: pd.DataFrame | None = None  # lifetimes.LIFETIME_COLUMNS: buffers per size class
    held_frees: pd.DataFrame | None = None  # held_frees.HELD_COLUMNS: CUDA frees held back by events
    _ranges: dict[int, tuple[int, int]] | None = field(default=None, repr=False)
    _slot_columns: tuple[np.ndarray, list[np.ndarray]] | None = field(default=None, repr=False)
    _named: dict[int, dict[str, Any]] | None = field(default=None, repr=False)

    def rows(self, kind: str, tids: Any = None) -> pd.DataFrame:
        """Rows of `kind` by threads `tids` (None: every thread) that start inside the
        window."""
        frame = self.frames.get(kind)
        if frame is None or not len(frame):
            return pd.DataFrame(columns=["ts_ns", "dur_ns", "tid"])
        ts = as_int64(frame["ts_ns"])
        keep = (ts >= self.window.start_ns) & (ts < self.window.end_ns)
        if tids is not None:
            keep &= np.isin(as_int64(frame["tid"]), list(tids))
        return frame[keep]

    def intervals(self, state: str, tids: Any = None) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """State intervals in `state` of threads `tids` (default all), a thread at a time
        in tid order: (tid, the slot of each, its length, its ns inside the window);
        intervals wholly outside it left out.  The slots are sorted by tid, so a thread
        is a slice of them."""
        if self._ranges is None or self._slot_columns is None:
            self._ranges = thread_ranges(self.slots["tid"].to_numpy())
            self._slot_columns = codes(self.slots["state"]), [self.slots[name].to_numpy() for name in SLOT_EDGES]
        code = STATE_CODE[state]
        slot_state, edges = self._slot_columns
        parts = [p for p, c in enumerate(PART_CODES) if c in (code, -1)]  # -1: the slot's own state
        wanted = self._ranges if tids is None else {int(t) for t in tids}
        for tid in sorted(t for t in wanted if t in self._ranges):
            lo, hi = self._ranges[tid]
            # A thread's slots tile its life: inside the window, nothing needs clipping.
            inside = self.window.start_ns <= edges[0][lo] and edges[-1][hi - 1] <= self.window.end_ns
            found = []
            for part in parts:
                start, end = edges[part][lo:hi], edges[part + 1][lo:hi]
                ns = end - start if inside else clipped_lengths(start, end, self.window)
                hit = np.flatnonzero((ns > 0) & ((PART_CODES[part] == code) | (slot_state[lo:hi] == code)))
                found.append((lo + hit, end[hit] - start[hit], ns[hit]))
            yield (tid, *(np.concatenate(v) for v in zip(*found)))

    def thread(self, tid: int) -> dict[str, Any]:
        if self._named is None:  # looked up for every link and root of every finding
            self._named = {int(t): {"tid": int(t), "comm": str(c), "role": str(r)} for t, c, r in
                           zip(self.threads["tid"], self.threads["comm"], self.threads["role"])}
        return dict(self._named.get(int(tid)) or {"tid": int(tid), "comm": "", "role": "other"})


# What each category's record names as its evidence (analyzers/causes/categories.py).
Builder = Callable[[EvidenceContext, pd.DataFrame, list[int]], dict[str, Any]]


def _ms(values_ns: Any, prefix: str, *, reorder: bool = False) -> dict[str, float]:
    """p50/p99 of durations in ms, keyed `<prefix>_p50_ms`, `<prefix>_p99_ms`; `reorder`:
    the values are a float64 array of the caller's own that may be reordered in place."""
    v = values_ns if reorder else np.array(values_ns, dtype=np.float64)
    p50, p99 = (float(p) / 1e6 for p in np.percentile(v, (50, 99), overwrite_input=True)) if len(v) else (0.0, 0.0)
    return {f"{prefix}_p50_ms": p50, f"{prefix}_p99_ms": p99}


def _durations(rows: pd.DataFrame) -> np.ndarray:
    return np.maximum(as_int64(rows["dur_ns"], 0), 0) if len(rows) else np.zeros(0)


def _top_stack(ctx: EvidenceContext, ids: Any) -> str:
    ids = as_int64(pd.Series(ids))
    ids = ids[ids >= 0]
    if not len(ids):
        return ""
    return stack_excerpt(ctx.stacks, int(pd.Series(ids).value_counts().idxmax()))


def _with_python(ctx: EvidenceContext, native: str, ustacks: Any, frame: pd.DataFrame | None, waits: np.ndarray) -> str:
    """The futex waits' top user stack `native` (_top_stack of `ustacks`) with the Python
    frames the most of its waits held merged in (stacks.merged_excerpt); `native` as it is
    without any.  Only the native part is ever classified (allocator_in_stack)."""
    if not native or not len(ctx.pystacks) or frame is None or "pystack_id" not in frame:
        return native
    ustacks = as_int64(pd.Series(ustacks))
    top = int(pd.Series(ustacks[ustacks >= 0]).value_counts().idxmax())
    py = as_int64(frame["pystack_id"])[waits][ustacks == top]
    py = py[py >= 0]
    if not len(py):
        return native
    return merged_excerpt(ctx.stacks, ctx.pystacks, top, int(pd.Series(py).value_counts().idxmax()))


def futex_class_waits(cls: str) -> Builder:
    """Lock and GIL findings: the waits of futex class `cls` on the top addresses."""

    def build(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
        found, held_by = _futex_evidence(ctx, cls, roots), holders(ctx, pieces)
        if cls != "lock":
            return {**found, "holders": held_by}
        names = found["address_names"]
        return {**found, "holders": held_by, **lock_identity(
            found["addresses"][0] if found["addresses"] else "", names[0] if names else "", found["user_stack"], held_by)}

    return build


def holders(ctx: EvidenceContext, pieces: pd.DataFrame) -> list[dict[str, Any]]:
    """The threads that ended the trainer's waits behind these pieces (a lock's or the
    GIL's holders: the release wakes the next waiter), most waiting time first, with the
    seconds of it each ended and, where the trace has them, the Python frames it woke
    the trainer from (locks.holder_frames)."""
    waits = pieces.loc[(pieces["state"] != "running").to_numpy()]
    interval = waits["interval"].to_numpy(np.int64)
    waker = ctx.trainer_states["waker_tid"].to_numpy(np.int64)[interval]
    weights = waits["ns"].to_numpy(np.float64)
    ns = pd.Series(weights).groupby(waker).sum()
    ns = ns[ns.index >= 0].sort_values(ascending=False)
    peer = ctx.trainer_states["peer_pystack_id"].to_numpy(np.int64)[interval] \
        if "peer_pystack_id" in ctx.trainer_states else None
    return [{**ctx.thread(int(t)), "seconds": float(v) / NS_PER_S,
             **holder_frames(ctx.pystacks, waker, peer, weights, int(t))} for t, v in ns.iloc[:MAX_THREADS].items()]


def _futex_evidence(ctx: EvidenceContext, cls: str, roots: list[int]) -> dict[str, Any]:
    fw = ctx.futex_waits
    pid, tid, addr = fw["pid"].to_numpy(), fw["tid"].to_numpy(), fw["addr"].to_numpy()
    start, end = fw["start_ns"].to_numpy(), fw["end_ns"].to_numpy()
    waits = np.flatnonzero((codes(fw["cls"]) == FUTEX_CODE[cls]) & np.isin(tid, roots)
                           & (start < ctx.window.end_ns) & (end > ctx.window.start_ns))
    ns = end[waits] - start[waits]
    by_addr = pd.Series(ns).groupby([pid[waits], addr[waits]]).sum()
    top = by_addr.sort_values(ascending=False).index[:3]
    addrs = [int(a) for _, a in top]
    on_addrs = np.zeros(len(fw), bool)
    for p, a in top:
        on_addrs |= (pid == p) & (addr == a)
    frame = ctx.frames.get("futex")
    ustacks = frame["ustack_id"].to_numpy()[waits] if frame is not None and len(waits) else []
    stack = _top_stack(ctx, ustacks)
    # What the recorder found at each address: "_PyRuntime+0x1b0 [python3.11]", a /dev/shm path.
    names = [str(n) for n in address_names(ctx.frames.get("futex_addr"), np.array([p for p, _ in top], np.int64),
                                           np.array(addrs, np.uint64))]
    allocator = (bool(stack) and any(k in stack for k in ("malloc", "free", "arena", "tcache"))) \
        or any(n.startswith("main_arena+") for n in names)
    return {
        "futex_waits": int(len(waits)),
        **_ms(ns, "futex_wait"),
        "addresses": [hex(a) for a in addrs],
        "address_names": names,
        "waiting_threads": int(len(np.unique(tid[on_addrs]))),
        "handoff_share": float(fw["handoff"].to_numpy()[waits].mean()) if len(waits) else 0.0,
        "user_stack": _with_python(ctx, stack, ustacks, frame, waits),
        "allocator_in_stack": allocator,
    }


def contenders(ctx: EvidenceContext, futex_class: str | None, roots: list[int]) -> list[int]:
    """For lock and GIL findings (futex waits of `futex_class`): the other threads waiting
    on the same addresses."""
    if futex_class is None:
        return []
    waits = ctx.futex_waits[(ctx.futex_waits["cls"] == futex_class).to_numpy()]
    key = pair_ids(waits["pid"].to_numpy(), waits["addr"].to_numpy().view(np.int64))
    by_root = waits["tid"].isin(roots).to_numpy()
    others = waits[np.isin(key, key[by_root]) & ~by_root]
    by_time = (others["end_ns"] - others["start_ns"]).groupby(others["tid"]).sum().sort_values(ascending=False)
    return [int(t) for t in by_time.index]


def trainer_waits(ctx: EvidenceContext, pieces: pd.DataFrame) -> dict[str, Any]:
    """Every finding's evidence: the trainer's own waits behind it (not its running time)."""
    waits = pieces.loc[(pieces["state"] != "running").to_numpy(), "interval"].unique()
    if not len(waits):
        return {}
    ts = ctx.trainer_states
    return {"trainer_waits": int(len(waits)),
            **_ms(ts["end_ns"].to_numpy()[waits] - ts["start_ns"].to_numpy()[waits], "wait")}


def input_pipeline(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    by_root = pieces.groupby("root_tid")["ns"].sum().sort_values(ascending=False)
    return {"producers": [{**ctx.thread(int(t)), "seconds": float(ns) / NS_PER_S} for t, ns in by_root.iloc[:MAX_THREADS].items()]}


def cpu_contention(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    runq, per, every = [], {}, 0
    roots = set(roots)
    for tid, _, length, ns in ctx.intervals("runnable"):
        every += int(ns.sum())
        if tid in roots and len(ns):
            runq.append(length)
            per[tid] = int(ns.sum())
    by_thread = pd.Series(per, dtype=np.int64).sort_values(ascending=False)
    return {
        "runnable_intervals": int(sum(len(r) for r in runq)),
        **_ms(np.concatenate(runq, dtype=np.float64) if runq else np.zeros(0), "runq", reorder=True),
        "runnable_s": {str(int(t)): float(ns) / NS_PER_S for t, ns in by_thread.iloc[:MAX_THREADS].items()},
        "all_threads_runnable_s": float(every) / NS_PER_S,
        "threads_traced": int(len(ctx.threads)),
        **preempted_by(ctx, roots),
    }


def preempted_by(ctx: EvidenceContext, roots: Any) -> dict[str, Any]:
    """The tasks that took the CPU from threads `roots` in the window (the sched probe's
    preemption counts), most preemptions first, each marked whether the traced tree holds
    it; and the preemptions in all."""
    rows = ctx.rows("preempted_by", roots)
    if not len(rows):
        return {"preemptions": 0, "preempted_by": []}
    count = as_int64(rows["preemptions"], 0)
    by_peer = pd.DataFrame({"ts_ns": as_int64(rows["ts_ns"]), "peer_tid": as_int64(rows["peer_tid"]), "count": count,
                            "peer_pid": as_int64(rows["peer_pid"], -1), "comm": rows["comm"].astype(str).to_numpy()})
    # The newest row names a task: its comm at its last flush, its pid where still known.
    top = by_peer.sort_values("ts_ns", kind="stable").groupby("peer_tid", as_index=False).agg(
        preemptions=("count", "sum"), peer_pid=("peer_pid", "max"), comm=("comm", "last"))
    top = top.sort_values("preemptions", ascending=False, kind="stable").iloc[:MAX_THREADS]
    traced = set(ctx.threads["tid"].tolist())
    return {"preemptions": int(count.sum()), "preempted_by": [
        {"tid": int(r.peer_tid), "pid": int(r.peer_pid) if r.peer_pid >= 0 else None,
         # tid 0: tasks the sudo user could not see (hidepid), left unnamed by the recorder
         "comm": str(r.comm) if r.peer_tid else UNSEEN_TASKS,
         "preemptions": int(r.preemptions), "traced": int(r.peer_tid) in traced} for r in top.itertuples()]}


# What a preempting task the recording user could not see is called.
UNSEEN_TASKS = "(other users' processes)"


def allocator_churn(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    churn = ctx.churn[ctx.churn["tid"].isin(roots)]
    calls = ctx.rows("mm_syscall", roots)
    by_name = calls["syscall"].astype(str).value_counts() if len(calls) else pd.Series(dtype=np.int64)
    return {
        "mm_calls": int(churn["calls"].sum()),
        "mm_calls_per_s": float(churn["calls_per_s"].sum()),
        "calls_by_syscall": {str(k): int(v) for k, v in by_name.items()},
        "mapped_bytes": int(churn["map_bytes"].sum()),
        "unmapped_bytes": int(churn["unmap_bytes"].sum()),
        "median_size_bytes": float(churn["median_size"].median()) if len(churn) else 0.0,
        "faults": int(churn["faults"].sum()),
        "faults_per_s": float(churn["faults_per_s"].sum()),
        **_huge_pages(ctx, roots),
        **freed_late(ctx, roots),
    }


def _huge_pages(ctx: EvidenceContext, roots: list[int]) -> dict[str, Any]:
    """Whether the processes of `roots` got their fresh memory in huge pages (huge_pages.page_evidence)."""
    pids = ctx.threads.loc[ctx.threads["tid"].isin(roots), "pid"].unique().tolist() if len(ctx.threads) else []
    return {**page_evidence(ctx.pages, pids, ctx.thp), **_shootdowns(ctx, roots)}


def _shootdowns(ctx: EvidenceContext, roots: list[int]) -> dict[str, Any]:
    """The TLB shootdowns that interrupted the finding's threads and the trainer, and the
    threads whose unmaps sent them (tlb.shootdown_evidence)."""
    tids = sorted(set(roots) | set(ctx.trainer_states["tid"].unique().tolist() if len(ctx.trainer_states) else []))
    names = dict(zip(ctx.threads["tid"].tolist(), ctx.threads["comm"].astype(str).tolist())) if len(ctx.threads) else {}
    return shootdown_evidence(ctx.shootdowns, tids, names, ctx.mm_calls)


def page_faults(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    faults = ctx.rows("faults", roots)
    count = int(np.maximum(as_int64(faults["faults"], 0), 0).sum()) if len(faults) else 0
    blocked = list(ctx.intervals("page_faults", roots))
    slots = np.concatenate([slot for _, slot, _, _ in blocked]) if blocked else np.zeros(0, np.int64)
    return {
        "faults": count,
        "faults_per_s": count / max(ctx.window.seconds, 1e-9),
        "blocked_in_fault_path_s": float(sum(int(ns.sum()) for *_, ns in blocked)) / NS_PER_S,
        "running_in_fault_path_s": float(pieces.loc[pieces["state"] == "running", "ns"].sum()) / NS_PER_S,
        "kernel_stack": _top_stack(ctx, ctx.slots["kstack_id"].to_numpy()[slots]),
        **_huge_pages(ctx, roots),
    }


def _interval_rows(kind: str, extra: Callable[[pd.DataFrame], dict[str, Any]] | None = None):
    def build(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
        rows = ctx.rows(kind, roots)
        out = {f"{kind}_events": int(len(rows)), **_ms(_durations(rows), kind)}
        if extra is not None and len(rows):
            out.update(extra(rows))
        return out

    return build


def memory_reclaim(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    out = _interval_rows("reclaim", lambda r: {
        "pages_reclaimed": int(as_int64(r["pages_reclaimed"], 0).sum()),
        "kinds": {str(k): int(v) for k, v in r["state"].astype(str).value_counts().items()},
    })(ctx, pieces, roots)
    out["compaction_events"] = int(len(ctx.rows("compaction", roots)))
    return {**out, **reclaim_culprits(ctx, roots)}


def numa_placement(ctx: EvidenceContext, roots: list[int]) -> dict[str, Any]:
    """Threads that ran mostly off the GPU's node (of `roots` when any is), and where the
    target's memory lies."""
    pl = ctx.placement
    remote = pl[pl["remote_fraction"] > REMOTE_MIN_FRACTION]
    focus = remote if not roots else remote[remote["tid"].isin(roots)]
    return {
        "gpu_node": ctx.gpu_node,
        "remote_threads": [
            {**ctx.thread(int(r.tid)), "remote_fraction": float(r.remote_fraction), "main_node": int(r.main_node)}
            for r in (focus if len(focus) else remote).head(MAX_THREADS).itertuples()
        ],
        "memory_pages_by_node": {str(k): v for k, v in ctx.memory_nodes.items()},
        "copies": ctx.copies, **copy_case(ctx.copies, ctx.topology, ctx.thread),
    }


def mmap_lock(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    return _interval_rows("mmap_lock", lambda r: {
        "write_waits": int((r["state"].astype(str) == "write").sum()),
        "read_waits": int((r["state"].astype(str) == "read").sum()),
    })(ctx, pieces, roots)


def dirty_throttling(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    return {**_interval_rows("dirty_pause", lambda r: {
        "dirty_pages_max": int(as_int64(r["dirty_pages"], 0).max()),
        "dirty_limit_pages": int(as_int64(r["limit_pages"], 0).max()),
        "devices": sorted({str(d) for d in r["device"].dropna()}),
    })(ctx, pieces, roots), **io_culprits(ctx, pieces, roots, dirtying=True)}


def block_io(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    return {**_interval_rows("block_rq", lambda r: {
        "bytes": int(as_int64(r["bytes"], 0).sum()),
        "ops": {str(k): int(v) for k, v in r["rwbs"].astype(str).value_counts().items()},
    })(ctx, pieces, roots), **io_culprits(ctx, pieces, roots)}


def numa_remote(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    return numa_placement(ctx, roots)


def collective(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    """The collective backend's threads that ended the trainer's waits."""
    waits = pieces["interval"].unique()
    wakers = pd.Series(ctx.trainer_states["waker_tid"].to_numpy(np.int64)[waits]).value_counts()
    return {"backend_threads": [{**ctx.thread(int(t)), "waits": int(n)} for t, n in wakers.iloc[:MAX_THREADS].items() if t >= 0]}


def unexplained(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    return {"states_s": {str(k): float(v) / NS_PER_S
                         for k, v in pieces.groupby("state", observed=True)["ns"].sum().items()}}
