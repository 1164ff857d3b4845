"""From attributed starved time to ranked findings.

Every starved piece carries exactly one category, so the shares of distinct findings
(category ns / starved ns) never add up to more than 1.  Two refinements move time
between categories on evidence about the thread at the root of a piece's chain: faults of
a thread that churns mappings are allocator churn, and data production on a thread that
mostly ran on a node other than the GPU's is (in that proportion) remote NUMA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.categories import (
    CATEGORIES, CATEGORY_CODE, CATEGORY_DTYPE, FUTEX_CODE, RUN_CLASSES, STATE_CODE, STATE_DTYPE, codes,
)
from trainbpf.analyzers.attribution import address_names
from trainbpf.analyzers.chains import RUN_CATEGORY, interval_category_codes, is_followed
from trainbpf.analyzers.intervals import NS_PER_S, Span, as_int64, pair_ids, run_parallel, thread_ranges
from trainbpf.analyzers.numa import REMOTE_MIN_FRACTION
from trainbpf.analyzers.stacks import stack_excerpt
from trainbpf.analyzers.states import PART_CODES, SLOT_EDGES, clipped_lengths

# Severity: share of starved time, and how much of the analysed window that time is
# (a large share of a few stray milliseconds is not worth fixing first).
CRITICAL_SHARE = 0.25
WARNING_SHARE = 0.05
CRITICAL_MIN_IMPACT = 0.05
WARNING_MIN_IMPACT = 0.01
MAX_THREADS = 5
# Categories explaining less starved time than this are noise, not findings.
MIN_FINDING_NS = 1_000_000

RECOMMENDATIONS: dict[str, str] = {
    "input_pipeline": "The trainer waits for data that is still being produced: add data-loader workers "
    "(num_workers), make decoding cheaper or move it off the critical path (pre-decode, cache decoded "
    "samples), and prefetch more batches (prefetch_factor, pin_memory).",
    "cpu_contention": "Threads are runnable but get no CPU: run fewer threads (torch.set_num_threads, "
    "OMP_NUM_THREADS, fewer workers), isolate cores for the trainer, and pin threads (taskset, "
    "sched_setaffinity) so data workers do not preempt it.",
    "lock_contention": "Threads queue on a shared lock: reduce sharing (per-thread queues and buffers); "
    "if the lock is the allocator's (malloc/arena frames in the stack) use a thread-caching allocator "
    "(tcmalloc or jemalloc via LD_PRELOAD) or tune MALLOC_ARENA_MAX; or run fewer threads.",
    "gil_contention": "Python threads fight for the GIL: move CPU-heavy work to processes (DataLoader "
    "workers) or to code that releases the GIL (numpy, torch ops), and cut the number of Python threads.",
    "allocator_churn": "Memory is mapped and unmapped over and over, and every fresh page faults: pool and "
    "reuse buffers (size-class pools, caching allocators), raise the mmap threshold "
    "(MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, or tcmalloc/jemalloc), and use huge pages.",
    "page_faults": "Time goes to page faults: pre-fault or pin buffers once (MAP_POPULATE, mlock, touching "
    "them at start), reuse pooled memory, and use huge pages (fewer faults and TLB misses).",
    "mmap_lock": "Threads wait for the process's mmap_lock: make fewer mmap/munmap/mprotect calls while "
    "other threads fault (pool buffers, allocate up front, batch unmaps).",
    "memory_reclaim": "Allocations wait for the kernel to reclaim or compact memory: raise or remove the "
    "memory limit (cgroup memory.max/memory.high), reduce page-cache pressure (drop caches, O_DIRECT for "
    "big reads) and pre-allocate memory before training.",
    "dirty_throttling": "Writers are throttled for dirty pages (balance_dirty_pages): write checkpoints with "
    "O_DIRECT or io_uring, lower or tune vm.dirty_bytes/dirty_background_bytes, put the writer in its own "
    "cgroup/io class, or stream checkpoints to object storage.",
    "block_io": "Threads wait for block I/O: use faster storage or a local cache, prefetch and read ahead, "
    "and warm the page cache before training.",
    "numa_remote": "Data-loading threads run on a NUMA node other than the GPU's: bind them and their "
    "memory to the GPU's node (numactl --cpunodebind/--membind, sched_setaffinity in worker_init_fn).",
    "other": "Time the trace cannot attribute (timer sleeps, short waits, untraced wakers): record with "
    "more probes (futex, faults, mm, writeback, block) or a lower --min-block-us to see more.",
}

# RUN_CLASS_DTYPE code -> CATEGORY code (code 0, not running, is never looked up).
_RUN_CLASS_CATEGORY = np.array([0] + [CATEGORIES.index(RUN_CATEGORY[c]) for c in RUN_CLASSES], dtype=np.int8)
# interval: the trainer state interval (position among its states) the piece lies in;
# end: the row of the chain ends that shared it out, -1 for pieces not followed.
ATTRIBUTED_COLUMNS = ("start_ns", "end_ns", "ns", "state", "category", "root_tid", "interval", "end")
FINDING_COLUMNS = (
    "category", "share", "seconds", "severity", "threads", "chain", "summary", "evidence", "recommendation",
)


def attribute_starved(
    pieces: pd.DataFrame,
    trainer_states: pd.DataFrame,
    chain_ends: pd.DataFrame,
    *,
    trainer_tid: int | None,
    churn: pd.DataFrame,
    placement: pd.DataFrame,
) -> pd.DataFrame:
    """Categories and root threads of the starved pieces: a piece the trainer spent in a
    followed wait is shared out as its chain ended (`end` = row of `chain_ends`, else -1)."""
    iv = pieces["interval"].to_numpy(np.int64)
    st_state = codes(trainer_states["state"])[iv]
    st_fclass = codes(trainer_states["futex_class"])[iv]
    st_waker = trainer_states["waker_tid"].to_numpy(np.int64)[iv]
    run_class = codes(pieces["run_class"])
    running = run_class > 0
    trainer = -1 if trainer_tid is None else int(trainer_tid)

    category = interval_category_codes(st_state, st_fclass).astype(np.int8)
    category[running] = _RUN_CLASS_CATEGORY[run_class[running]]
    ns = pieces["ns"].to_numpy(np.float64)
    rows = np.arange(len(pieces))
    root = np.full(len(pieces), trainer, dtype=np.int64)
    end = np.full(len(pieces), -1, dtype=np.int64)
    followed = ~running & is_followed(st_state, st_fclass, st_waker)
    ended = np.zeros(len(pieces), bool)
    if followed.any() and len(chain_ends):
        e_wait = chain_ends["wait"].to_numpy(np.int64)  # sorted
        lo = np.searchsorted(e_wait, iv, side="left")
        count = np.where(followed, np.searchsorted(e_wait, iv, side="right") - lo, 0)
        ended = count > 0
        # One row per (piece, end of its wait's chain), weighted by the end's share.
        piece = np.repeat(rows, count)
        at = np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        rows = np.concatenate([rows[~ended], piece])
        ns = np.concatenate([ns[~ended], ns[piece] * chain_ends["weight"].to_numpy()[at]])
        category = np.concatenate([category[~ended], codes(chain_ends["category"])[at]])
        root = np.concatenate([root[~ended], chain_ends["tid"].to_numpy(np.int64)[at]])
        end = np.concatenate([end[~ended], at])
    interval = iv[rows]
    start, stop = pieces["start_ns"].to_numpy(np.int64)[rows], pieces["end_ns"].to_numpy(np.int64)[rows]
    state = codes(pieces["state"])[rows]
    if len(churn):
        churning = churn.loc[churn["churning"], "tid"].to_numpy()
        hit = (category == CATEGORY_CODE["page_faults"]) & np.isin(root, churning)
        category[hit] = CATEGORY_CODE["allocator_churn"]
    if len(placement):
        remote = pd.Series(placement["remote_fraction"].to_numpy(), index=placement["tid"].to_numpy())
        frac = remote.reindex(root).fillna(0.0).to_numpy()
        hit = np.flatnonzero((category == CATEGORY_CODE["input_pipeline"]) & (frac > REMOTE_MIN_FRACTION))
        if len(hit):
            moved = ns[hit] * frac[hit]
            ns = ns.copy()
            ns[hit] -= moved
            start, stop, state, root, interval, end = (
                np.concatenate([x, x[hit]]) for x in (start, stop, state, root, interval, end)
            )
            category = np.concatenate([category, np.full(len(hit), CATEGORY_CODE["numa_remote"], np.int8)])
            ns = np.concatenate([ns, moved])
    keep = ns > 0
    out = pd.DataFrame({
        "start_ns": start[keep], "end_ns": stop[keep], "ns": ns[keep],
        "state": pd.Categorical.from_codes(state[keep], dtype=STATE_DTYPE),
        "category": pd.Categorical.from_codes(category[keep], dtype=CATEGORY_DTYPE),
        "root_tid": root[keep], "interval": interval[keep].astype(np.int64), "end": end[keep].astype(np.int64),
    })
    return out.sort_values("start_ns", kind="stable")[list(ATTRIBUTED_COLUMNS)].reset_index(drop=True)


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
    _ranges: dict[int, tuple[int, int]] | None = field(default=None, repr=False)

    def rows(self, kind: str, tids: Any) -> pd.DataFrame:
        """Rows of `kind` by threads `tids` that start inside the window."""
        frame = self.frames.get(kind)
        if frame is None or not len(frame):
            return pd.DataFrame(columns=["ts_ns", "dur_ns", "tid"])
        ts = as_int64(frame["ts_ns"])
        keep = (ts >= self.window.start_ns) & (ts < self.window.end_ns) & np.isin(as_int64(frame["tid"]), list(tids))
        return frame[keep]

    def intervals(self, state: str, tids: Any = None) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """State intervals in `state` of threads `tids` (default all), a thread at a time
        in tid order: (tid, the slot of each, its length, its ns inside the window);
        intervals wholly outside it left out.  The slots are sorted by tid, so a thread
        is a slice of them."""
        if self._ranges is None:
            self._ranges = thread_ranges(self.slots["tid"].to_numpy())
        code = STATE_CODE[state]
        slot_state = codes(self.slots["state"])
        edges = [self.slots[name].to_numpy() for name in SLOT_EDGES]
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
        row = self.threads.loc[self.threads["tid"] == tid]
        if not len(row):
            return {"tid": int(tid), "comm": "", "role": "other"}
        return {"tid": int(tid), "comm": str(row["comm"].iloc[0]), "role": str(row["role"].iloc[0])}


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
    stack = _top_stack(ctx, frame["ustack_id"].to_numpy()[waits] if frame is not None and len(waits) else [])
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
        "user_stack": stack,
        "allocator_in_stack": allocator,
    }


def _contenders(ctx: EvidenceContext, category: str, roots: list[int]) -> list[int]:
    """For lock and GIL findings: the other threads waiting on the same addresses."""
    cls = {"lock_contention": "lock", "gil_contention": "gil"}.get(category)
    if cls is None:
        return []
    waits = ctx.futex_waits[(ctx.futex_waits["cls"] == cls).to_numpy()]
    key = pair_ids(waits["pid"].to_numpy(), waits["addr"].to_numpy().view(np.int64))
    by_root = waits["tid"].isin(roots).to_numpy()
    others = waits[np.isin(key, key[by_root]) & ~by_root]
    by_time = (others["end_ns"] - others["start_ns"]).groupby(others["tid"]).sum().sort_values(ascending=False)
    return [int(t) for t in by_time.index]


def _evidence(category: str, ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    # The trainer's own waits behind this finding (not its running time).
    waits = pieces.loc[(pieces["state"] != "running").to_numpy(), "interval"].unique()
    if len(waits):
        ts = ctx.trainer_states
        ev["trainer_waits"] = int(len(waits))
        ev.update(_ms(ts["end_ns"].to_numpy()[waits] - ts["start_ns"].to_numpy()[waits], "wait"))
    builder = _EVIDENCE.get(category)
    if builder is not None:
        ev.update(builder(ctx, pieces, roots))
    return ev


def _input_pipeline(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    by_root = pieces.groupby("root_tid")["ns"].sum().sort_values(ascending=False)
    return {"producers": [{**ctx.thread(int(t)), "seconds": float(ns) / NS_PER_S} for t, ns in by_root.iloc[:MAX_THREADS].items()]}


def _cpu_contention(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
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
    }


def _churn(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    churn = ctx.churn[ctx.churn["tid"].isin(roots)]
    calls = ctx.rows("mm_syscall", roots)
    by_name = calls["name"].astype(str).value_counts() if len(calls) else pd.Series(dtype=np.int64)
    return {
        "mm_calls": int(churn["calls"].sum()),
        "mm_calls_per_s": float(churn["calls_per_s"].sum()),
        "calls_by_syscall": {str(k): int(v) for k, v in by_name.items()},
        "mapped_bytes": int(churn["map_bytes"].sum()),
        "unmapped_bytes": int(churn["unmap_bytes"].sum()),
        "median_size_bytes": float(churn["median_size"].median()) if len(churn) else 0.0,
        "faults": int(churn["faults"].sum()),
        "faults_per_s": float(churn["faults_per_s"].sum()),
    }


def _page_faults(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    faults = ctx.rows("faults", roots)
    count = int(np.maximum(as_int64(faults["count"], 0), 0).sum()) if len(faults) else 0
    blocked = list(ctx.intervals("page_faults", roots))
    slots = np.concatenate([slot for _, slot, _, _ in blocked]) if blocked else np.zeros(0, np.int64)
    return {
        "faults": count,
        "faults_per_s": count / max(ctx.window.seconds, 1e-9),
        "blocked_in_fault_path_s": float(sum(int(ns.sum()) for *_, ns in blocked)) / NS_PER_S,
        "running_in_fault_path_s": float(pieces.loc[pieces["state"] == "running", "ns"].sum()) / NS_PER_S,
        "kernel_stack": _top_stack(ctx, ctx.slots["kstack_id"].to_numpy()[slots]),
    }


def _interval_rows(kind: str, extra: Callable[[pd.DataFrame], dict[str, Any]] | None = None):
    def build(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
        rows = ctx.rows(kind, roots)
        out = {f"{kind}_events": int(len(rows)), **_ms(_durations(rows), kind)}
        if extra is not None and len(rows):
            out.update(extra(rows))
        return out

    return build


def _reclaim(ctx: EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    out = _interval_rows("reclaim", lambda r: {
        "pages_reclaimed": int(as_int64(r["count"], 0).sum()),
        "kinds": {str(k): int(v) for k, v in r["state"].astype(str).value_counts().items()},
    })(ctx, pieces, roots)
    out["compaction_events"] = int(len(ctx.rows("compaction", roots)))
    return out


_EVIDENCE: dict[str, Callable[[EvidenceContext, pd.DataFrame, list[int]], dict[str, Any]]] = {
    "input_pipeline": _input_pipeline,
    "cpu_contention": _cpu_contention,
    "lock_contention": lambda ctx, p, roots: _futex_evidence(ctx, "lock", roots),
    "gil_contention": lambda ctx, p, roots: _futex_evidence(ctx, "gil", roots),
    "allocator_churn": _churn,
    "page_faults": _page_faults,
    "mmap_lock": _interval_rows("mmap_lock", lambda r: {
        "write_waits": int((r["state"].astype(str) == "write").sum()),
        "read_waits": int((r["state"].astype(str) == "read").sum()),
    }),
    "memory_reclaim": _reclaim,
    "dirty_throttling": _interval_rows("dirty_pause", lambda r: {
        "dirty_pages_max": int(as_int64(r["count"], 0).max()),
        "dirty_limit_pages": int(as_int64(r["size"], 0).max()),
        "devices": sorted({str(d) for d in r["name"].dropna()}),
    }),
    "block_io": _interval_rows("block_rq", lambda r: {
        "bytes": int(as_int64(r["size"], 0).sum()),
        "ops": {str(k): int(v) for k, v in r["name"].astype(str).value_counts().items()},
    }),
    "numa_remote": lambda ctx, p, roots: _numa(ctx, roots),
    "other": lambda ctx, p, roots: {
        "states_s": {str(k): float(v) / NS_PER_S for k, v in p.groupby("state", observed=True)["ns"].sum().items()}
    },
}


def _numa(ctx: EvidenceContext, roots: list[int]) -> dict[str, Any]:
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
    }


SUMMARIES: dict[str, str] = {
    "input_pipeline": "The trainer waited {s:.2f} s for data that {who} was still producing",
    "cpu_contention": "{who} waited {s:.2f} s runnable for a CPU while the GPU starved",
    "lock_contention": "{who} waited {s:.2f} s on a contended lock",
    "gil_contention": "{who} waited {s:.2f} s for the Python GIL",
    "allocator_churn": "{who} lost {s:.2f} s to faults on freshly mapped memory amid mmap/munmap churn",
    "page_faults": "{who} lost {s:.2f} s in the page-fault path",
    "mmap_lock": "{who} waited {s:.2f} s for the mmap_lock",
    "memory_reclaim": "{who} lost {s:.2f} s to direct memory reclaim and compaction",
    "dirty_throttling": "{who} was throttled {s:.2f} s writing dirty pages (balance_dirty_pages)",
    "block_io": "{who} waited {s:.2f} s for block I/O",
    "numa_remote": "{who} produced data on a NUMA node other than the GPU's, costing {s:.2f} s",
    "other": "{s:.2f} s of starved time has no cause the trace can name",
}


def severity(share: float, seconds: float, window_s: float, category: str) -> str:
    impact = seconds / window_s if window_s > 0 else 0.0
    if category != "other" and share >= CRITICAL_SHARE and impact >= CRITICAL_MIN_IMPACT:
        return "critical"
    if share >= WARNING_SHARE and impact >= WARNING_MIN_IMPACT:
        return "warning"
    return "info"


def _dominant_chain(
    pieces: pd.DataFrame, links: pd.DataFrame, ends: pd.DataFrame, keys: np.ndarray, ctx: EvidenceContext,
    trainer_tid: int,
) -> list[dict[str, Any]]:
    """The chain of this finding that explains the most time, as links."""
    followed = pieces[pieces["end"] >= 0]
    direct = pieces[pieces["end"] < 0]
    best_direct = direct.groupby("state", observed=True)["ns"].sum() if len(direct) else pd.Series(dtype=float)
    best: tuple[float, list[dict[str, Any]]] = (-1.0, [])
    if len(best_direct):
        state = str(best_direct.idxmax())
        run = direct[direct["state"] == state]
        label = state
        if state == "running":
            label = "running/" + str(run.groupby("category", observed=True)["ns"].sum().idxmax())
        best = (float(best_direct.max()), [{**_link(ctx, trainer_tid), "state": label}])
    if len(followed):
        per_key = followed["ns"].groupby(keys[followed["end"].to_numpy()]).sum()
        if float(per_key.max()) > best[0]:
            at = int(followed["end"].to_numpy()[keys[followed["end"].to_numpy()] == per_key.idxmax()][0])
            e = ends.iloc[at]
            path = chain_path(links, int(e["link"]))
            chain = [{**_link(ctx, int(r.tid)), "state": str(r.state)} for r in path.itertuples()]
            best = (float(per_key.max()), chain + [{**_link(ctx, int(e["tid"])), "state": str(e["state"])}])
    return best[1]


def chain_keys(links: pd.DataFrame, ends: pd.DataFrame) -> np.ndarray:
    """Per row of `ends`, a 64-bit key equal for ends reached along the same chain (the
    same thread and state at every depth, and the same end): each link's code times a
    per-depth odd constant, summed with wrap-around down the parent links.  Collisions
    are vanishingly unlikely and would only merge two chains in the display."""
    tid = np.concatenate([links["tid"].to_numpy(np.int64), ends["tid"].to_numpy(np.int64)])
    state = np.concatenate([links["state"].to_numpy(dtype=object), ends["state"].to_numpy(dtype=object)])
    code = pd.MultiIndex.from_arrays([tid, state]).factorize()[0].astype(np.uint64) + np.uint64(1)
    depth = np.concatenate([links["depth"].to_numpy(np.int64), ends["depth"].to_numpy(np.int64)])
    mixers = np.random.default_rng(0).integers(1, 2**63, size=int(depth.max(initial=0)) + 1, dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        term = code * mixers[depth]
        path, end_term = term[: len(links)].copy(), term[len(links):]
        # Links are in depth order and a parent is always one depth up: a pass per depth.
        parent = links["parent"].to_numpy(np.int64)
        l_depth = links["depth"].to_numpy(np.int64)
        for d in range(1, int(l_depth.max(initial=0)) + 1):
            rows = np.flatnonzero(l_depth == d)
            path[rows] += path[parent[rows]]
        last = ends["link"].to_numpy(np.int64)
        return (np.where(last >= 0, path[np.maximum(last, 0)] if len(path) else 0, 0).astype(np.uint64)
                + end_term).astype(np.uint64)


def chain_path(links: pd.DataFrame, link: int) -> pd.DataFrame:
    """The links from the waiter down to row `link`, waiter first."""
    parent = links["parent"].to_numpy(np.int64)
    rows = []
    while link >= 0:
        rows.append(link)
        link = int(parent[link])
    return links.iloc[rows[::-1]]


def _link(ctx: EvidenceContext, tid: int) -> dict[str, Any]:
    t = ctx.thread(tid)
    return {"tid": t["tid"], "role": t["role"]}


def build_findings(
    attributed: pd.DataFrame, links: pd.DataFrame, ends: pd.DataFrame, ctx: EvidenceContext, *, trainer_tid: int | None
) -> pd.DataFrame:
    """One finding per category with starved time (plus remote-NUMA placement seen
    without starved time, as info), sorted by share, largest first."""
    total = float(attributed["ns"].sum())
    window_s = ctx.window.seconds
    trainer = -1 if trainer_tid is None else int(trainer_tid)
    per_cat = attributed.groupby("category", observed=True)["ns"].sum()
    keys = chain_keys(links, ends)
    in_category = attributed.groupby("category", observed=True).indices

    def finding(category: str) -> dict[str, Any] | None:
        ns = float(per_cat.get(category, 0.0))
        if ns < MIN_FINDING_NS:
            if category == "numa_remote" and len(ctx.placement) and (ctx.placement["remote_fraction"] > REMOTE_MIN_FRACTION).any():
                return _finding(category, 0.0, 0.0, window_s, [], [], _numa(ctx, []), ctx, remote_only=True)
            return None
        pieces = attributed.iloc[in_category[category]]
        by_root = pieces.groupby("root_tid")["ns"].sum().sort_values(ascending=False)
        roots = [int(t) for t in by_root.index]
        shown = roots + _contenders(ctx, category, roots)
        share = min(1.0, ns / total) if total > 0 else 0.0
        chain = _dominant_chain(pieces, links, ends, keys, ctx, trainer)
        evidence = {"starved_s": ns / NS_PER_S, **_evidence(category, ctx, pieces, roots)}
        return _finding(category, share, ns / NS_PER_S, window_s, shown[:MAX_THREADS], chain, evidence, ctx)

    # The categories' evidence is independent: gathered side by side.
    rows = [row for row in run_parallel([partial(finding, c) for c in CATEGORIES]) if row is not None]
    if not rows:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in FINDING_COLUMNS}).astype(
            {"share": np.float64, "seconds": np.float64}
        )
    out = pd.DataFrame(rows, columns=list(FINDING_COLUMNS))
    out["share"] = out["share"].astype(np.float64)
    out["seconds"] = out["seconds"].astype(np.float64)
    return out.sort_values(["share", "seconds"], ascending=False, kind="stable").reset_index(drop=True)


def _finding(
    category: str, share: float, seconds: float, window_s: float, roots: list[int], chain: list[dict[str, Any]],
    evidence: dict[str, Any], ctx: EvidenceContext, remote_only: bool = False,
) -> dict[str, Any]:
    threads = [ctx.thread(t) for t in roots] or [
        ctx.thread(int(t["tid"])) for t in evidence.get("remote_threads", [])
    ]
    who = _who(threads)
    if remote_only:
        summary = f"{who} ran mostly on a NUMA node other than the GPU's (node {ctx.gpu_node}), without measurable starved time"
    else:
        summary = SUMMARIES[category].format(s=seconds, who=who) + f" ({share:.0%} of starved time)"
    return {
        "category": category, "share": share, "seconds": seconds,
        "severity": severity(share, seconds, window_s, category), "threads": threads, "chain": chain,
        "summary": summary, "evidence": evidence, "recommendation": RECOMMENDATIONS[category],
    }


def _who(threads: list[dict[str, Any]]) -> str:
    if not threads:
        return "Threads"
    first = threads[0]
    name = f"{first['role']} {first['comm'] or '?'} ({first['tid']})"
    more = len(threads) - 1
    return name + (f" and {more} more thread{'s' if more > 1 else ''}" if more else "")
