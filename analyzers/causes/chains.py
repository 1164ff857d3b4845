"""Wake-up chains: whom a wait was waiting for, and what that thread was doing meanwhile.

A wait [a, t) ended by waker W at t is shared out by W's time inside [a, t): the part W
spent running means the awaited thing was still being produced (input_pipeline, or the
stall class W's on-CPU samples show); the part it spent runnable was still producing too
as far as the CPUs were busy with the pipeline itself, and otherwise could not get a CPU
(cpu_contention); the part it spent blocked is shared among W's blocked intervals inside
[a, t), each by its overlap, and each continues down the chain on its own branch, over
the overlap, where its own cause (or waker) decides.  A worker's feeder thread that
waited a second for the decoder and then a millisecond for the GIL before writing the
batch is a second of the decoder's running and a millisecond of GIL contention, not a
second of either.  One vectorised step per chain depth over all open branches at once; a
branch stops at a cause that is not followed, at a waker already on the same branch (a
cycle), at an untraced waker, or at MAX_DEPTH.  Sibling branches cover disjoint parts of
their parent's window, so a wait never has more branches than there are blocked
intervals inside it.

Two tables come out: `links`, the paths waits were followed along (one row per branch and
depth, depth 0 is the waiter; `parent` is the row of the link before it, -1 at depth 0),
and `ends`, where the shares ended, sorted by wait: one row per (branch, thread, state)
with the category, the weight (the fraction of the wait) and `link`, the row of the last
link before the end; a wait's weights sum to 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.attribution import RunSplit
from trainbpf.analyzers.causes.categories import (
    CATEGORIES,
    CATEGORY_DTYPE,
    FUTEX_CATEGORY,
    RUN_CATEGORY,
    STATE_CATEGORY,
)
from trainbpf.analyzers.intervals import ClassTime, thread_ranges
from trainbpf.analyzers.threads.states import BLOCKED_PART, PART_CODES, SLOT_EDGES, as_slots
from trainbpf.analyzers.vocab import (
    FOLLOWED_STATES,
    FUTEX_CLASSES,
    FUTEX_CODE,
    RUN_CLASSES,
    STATE_CODE,
    STATES,
    codes,
)

MAX_DEPTH = 16
LINK_COLUMNS = ("wait", "depth", "tid", "state", "parent")
END_COLUMNS = ("wait", "depth", "tid", "state", "category", "weight", "cycle", "link")
# Shares smaller than this fraction of a wait are dropped.
MIN_WEIGHT = 1e-6

_RUNNING, _RUNNABLE, _BLOCKED = 0, 1, 2


def interval_category(state: str, futex_class: str) -> str:
    """The category a blocked or runnable interval stands for when not followed further."""
    if state == "futex" and futex_class in FUTEX_CATEGORY:
        return FUTEX_CATEGORY[futex_class]
    return STATE_CATEGORY.get(state, "other")


# interval_category for every (state code, futex class code).
_INTERVAL_CATEGORY = np.array(
    [[CATEGORIES.index(interval_category(s, f)) for f in FUTEX_CLASSES] for s in STATES], dtype=np.int8
)
_FOLLOWED = np.array([STATE_CODE[s] for s in FOLLOWED_STATES])
_HANDOFF = np.array([FUTEX_CODE[cls] for cls in FUTEX_CATEGORY])


def interval_category_codes(state: np.ndarray, futex_class: np.ndarray) -> np.ndarray:
    """interval_category over code arrays, as CATEGORIES codes."""
    return _INTERVAL_CATEGORY[state, futex_class]


def is_followed(state: np.ndarray, futex_class: np.ndarray, waker: np.ndarray) -> np.ndarray:
    """Intervals (state and futex-class codes) whose cause lies with the thread that ended them."""
    return np.isin(state, _FOLLOWED) & (waker >= 0) & ~np.isin(futex_class, _HANDOFF)


def followed_waits(states: pd.DataFrame, rows: np.ndarray) -> pd.DataFrame:
    """The waits at positions `rows` of `states` in wait_chains' input form; a wait's id
    is its position."""
    st = states.iloc[rows]
    return pd.DataFrame({
        "wait": np.asarray(rows, dtype=np.int64), "tid": st["tid"].to_numpy(np.int64),
        "start_ns": st["start_ns"].to_numpy(np.int64), "end_ns": st["end_ns"].to_numpy(np.int64),
        "waker_tid": st["waker_tid"].to_numpy(np.int64), "state": np.asarray(st["state"], dtype=object),
    })


# The chain class of each part of a state slot; the short waits' blocked part and the
# slot's blocked part are the blocked intervals, followed to their wakers.
_PART_CLASSES = [_RUNNING if c == STATE_CODE["running"] else _RUNNABLE if c == STATE_CODE["runnable"] else _BLOCKED
                 for c in PART_CODES]
_SHORT_PART = PART_CODES.tolist().index(STATE_CODE["short_wait"])


class _Thread:
    """One thread's state slots (views of the slots' columns, sorted by start and, as
    they tile the thread's life, by end), indexed for window queries."""

    def __init__(self, edges: list[np.ndarray], state: np.ndarray, futex_class: np.ndarray, waker: np.ndarray):
        self.time = ClassTime.of_parts(edges, _PART_CLASSES, 3)
        self.edges, self.state, self.futex_class, self.waker = edges, state, futex_class, waker

    def blocked_within(self, a: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, ...]:
        """The blocked intervals overlapping each window [a, t), by window, then by time:
        (window, start, end, state, futex class, waker), as arrays."""
        lo = np.searchsorted(self.edges[-1], a, side="right")
        count = np.maximum(np.searchsorted(self.edges[0], t, side="left") - lo, 0)
        window = np.repeat(np.arange(len(a)), count)
        slot = np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        # Per slot, its two blocked parts in time order: the short waits' and its own.
        start = np.stack([self.edges[_SHORT_PART][slot], self.edges[BLOCKED_PART][slot]], axis=1)
        end = np.stack([self.edges[_SHORT_PART + 1][slot], self.edges[BLOCKED_PART + 1][slot]], axis=1)
        inside = (end > start) & (end > a[window, None]) & (start < t[window, None])
        n = len(slot)
        state = np.stack([np.full(n, STATE_CODE["short_wait"]), self.state[slot]], axis=1)
        futex_class = np.stack([np.full(n, FUTEX_CODE["none"]), self.futex_class[slot]], axis=1)
        waker = np.stack([np.full(n, -1), self.waker[slot]], axis=1)
        window = np.broadcast_to(window[:, None], inside.shape)
        return tuple(v[inside] for v in (window, start, end, state, futex_class, waker))


def _table(columns: tuple[str, ...], parts: list[dict], *, sort: bool) -> pd.DataFrame:
    """Concatenate row groups (dicts of equal-length arrays, or scalars) into a frame with
    the fixed columns and dtypes."""
    sizes = [len(p["wait"]) for p in parts]
    out = pd.DataFrame({
        c: np.concatenate([np.broadcast_to(np.asarray(p[c]), (k,)) for p, k in zip(parts, sizes)]) if parts else np.zeros(0)
        for c in columns
    })
    for c in ("wait", "depth", "tid", "parent", "link"):
        if c in columns:
            out[c] = out[c].astype(np.int64)
    out["state"] = out["state"].astype(object).astype(str)
    if "category" in columns:
        out["category"] = pd.Categorical(out["category"].to_numpy(dtype=object), dtype=CATEGORY_DTYPE)
        out["weight"] = out["weight"].astype(np.float64)
        out["cycle"] = out["cycle"].astype(bool)
    if sort:
        out = out.sort_values(["wait", "depth"], kind="stable")
    return out[list(columns)].reset_index(drop=True)


# Names by code, for the rows the walk records.
_STATE_NAMES = np.asarray(STATES, dtype=object)
_CATEGORY_NAMES = np.asarray(CATEGORIES, dtype=object)
_RUN_CATEGORY = np.asarray([RUN_CATEGORY[c] for c in RUN_CLASSES], dtype=object)


@dataclass
class _Branches:
    """The open branches of a walk: the wait each shares out, the window [a, t) its
    waker's time is looked at, the waker, the branch's weight, its last link, and the
    tids on it (`seen`: one array per depth)."""

    wait: np.ndarray
    a: np.ndarray
    t: np.ndarray
    waker: np.ndarray
    weight: np.ndarray
    link: np.ndarray
    seen: list[np.ndarray]


class _Walk:
    """One wait_chains walk: every thread's states (each thread's index built on first
    use) and the link and end rows found so far."""

    def __init__(self, states: pd.DataFrame, run_split: RunSplit, pipeline_tids: tuple[int, ...], n_cpus: int):
        slots = as_slots(states)
        self.spans = thread_ranges(slots["tid"].to_numpy())
        self.edges = [slots[name].to_numpy() for name in SLOT_EDGES]
        self.state, self.fclass = codes(slots["state"]), codes(slots["futex_class"])
        self.waker = slots["waker_tid"].to_numpy()
        self.cache: dict[int, _Thread] = {}
        self.run_split, self.pipeline_tids, self.n_cpus = run_split, pipeline_tids, n_cpus
        self.links: list[dict] = []
        self.ends: list[dict] = []
        self.n_links = 0

    def thread(self, tid: int) -> _Thread | None:
        """The thread's index; None for a thread with no time in its states (untraced)."""
        if tid not in self.cache:
            lo, hi = self.spans.get(tid, (0, 0))
            if hi == lo or self.edges[0][lo] == self.edges[-1][hi - 1]:
                return None
            self.cache[tid] = _Thread([e[lo:hi] for e in self.edges], self.state[lo:hi], self.fclass[lo:hi],
                                      self.waker[lo:hi])
        return self.cache[tid]

    def pipeline_busy(self, b: _Branches) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """ns each traced pipeline thread ran inside each branch's window, and their sum."""
        running = {}
        for p in self.pipeline_tids:  # a loop over threads
            th = self.thread(int(p))
            if th is not None:
                running[int(p)] = th.time.between(b.a, b.t)[:, _RUNNING]
        return running, sum(running.values(), np.zeros(len(b.wait), np.int64))

    def end(self, wait, depth, tid, state, category, weight, link, cycle=False) -> None:
        """Record where a share of some waits ended (scalars broadcast over the waits)."""
        keep = np.asarray(weight) > MIN_WEIGHT
        if keep.any():
            def each(value):
                return np.broadcast_to(np.asarray(value, dtype=object if isinstance(value, str) else None), keep.shape)[keep]

            self.ends.append({"wait": wait[keep], "depth": depth, "tid": each(tid), "state": each(state),
                              "category": each(category), "weight": np.asarray(weight, dtype=np.float64)[keep],
                              "cycle": each(cycle), "link": link[keep]})

    def link(self, wait: np.ndarray, depth: int, tid: np.ndarray, state: np.ndarray, parent: np.ndarray) -> np.ndarray:
        """Record links (a thread a wait's chain passed through); their link numbers."""
        self.links.append({"wait": wait, "depth": depth, "tid": tid, "state": state, "parent": parent})
        first, self.n_links = self.n_links, self.n_links + len(wait)
        return np.arange(first, self.n_links, dtype=np.int64)

    def waker_time(self, b: _Branches, w: int, idx: np.ndarray, depth: int, busy: list) -> tuple | None:
        """The waker `w`'s time inside the windows of branches `idx`: its running and
        runnable shares end there; its blocked intervals come back to be followed
        (branch, start, end, state, futex class, waker, overlap weight).  `busy`: the
        pipeline's running time at this depth, once computed."""
        th = self.thread(w)
        if th is None:
            self.end(b.wait[idx], depth, w, "untraced", "other", b.weight[idx], b.link[idx])
            return None
        times = th.time.between(b.a[idx], b.t[idx]).astype(np.float64)
        total = times.sum(axis=1)
        times[total == 0, _RUNNING] = 1.0  # a zero-length wait: the waker ran
        scale = b.weight[idx] / np.maximum(times.sum(axis=1), 1.0)
        run = scale * times[:, _RUNNING]
        split = self.run_split.fractions(w, b.a[idx], b.t[idx])
        for k in range(len(RUN_CLASSES)):
            self.end(b.wait[idx], depth, w, "running", _RUN_CATEGORY[k], run * split[:, k], b.link[idx])
        queued = scale * times[:, _RUNNABLE]
        if (queued > MIN_WEIGHT).any():
            busy[:] = busy or [self.pipeline_busy(b)]
            running, all_busy = busy[0]
            # The other pipeline threads' running time (integer ns: exact however summed).
            others = all_busy[idx] - running[w][idx] if w in running else all_busy[idx]
            own = np.clip(others / (max(self.n_cpus, 1) * np.maximum(times[:, _RUNNABLE], 1.0)), 0.0, 1.0)
            self.end(b.wait[idx], depth, w, "runnable", "input_pipeline", queued * own, b.link[idx])
            self.end(b.wait[idx], depth, w, "runnable", "cpu_contention", queued * (1.0 - own), b.link[idx])
        window, *blocked = th.blocked_within(b.a[idx], b.t[idx])
        if not len(window):
            return None
        branch = idx[window]
        overlap = np.minimum(blocked[1], b.t[branch]) - np.maximum(blocked[0], b.a[branch])
        return (branch, *blocked, scale[window] * np.maximum(overlap, 0))

    def step(self, b: _Branches, depth: int, max_depth: int) -> _Branches | None:
        """One depth of the walk: each branch's waker's time shared out; the branches that
        go on (through a followed blocked interval of the waker), or None."""
        children, busy = [], []
        for w, idx in pd.Series(np.arange(len(b.wait))).groupby(b.waker).indices.items():
            child = self.waker_time(b, int(w), idx, depth, busy)
            if child is not None:
                children.append(child)
        if not children:
            return None
        parent, c_start, c_end, c_state, c_fclass, c_waker, cw = (np.concatenate(c) for c in zip(*children))
        keep = cw > MIN_WEIGHT
        parent, c_start, c_end, c_state, c_fclass, c_waker, cw = (
            v[keep] for v in (parent, c_start, c_end, c_state, c_fclass, c_waker, cw)
        )
        follow = is_followed(c_state, c_fclass, c_waker)
        cycle = np.zeros(len(parent), dtype=bool)
        for prior in b.seen + [b.waker]:
            cycle |= follow & (c_waker == prior[parent])
        go = follow & ~cycle & (depth < max_depth)
        stop = ~go
        self.end(b.wait[parent[stop]], depth, b.waker[parent[stop]], _STATE_NAMES[c_state[stop]],
                 _CATEGORY_NAMES[interval_category_codes(c_state[stop], c_fclass[stop])],
                 cw[stop], b.link[parent[stop]], cycle[stop])
        g = parent[go]
        new_link = self.link(b.wait[g], depth, b.waker[g], _STATE_NAMES[c_state[go]], b.link[g]) if go.any() \
            else np.zeros(0, dtype=np.int64)
        # A branch goes on over the part of its window the waker spent in that interval.
        return _Branches(wait=b.wait[g], a=np.maximum(c_start[go], b.a[g]), t=np.minimum(c_end[go], b.t[g]),
                         waker=c_waker[go], weight=cw[go], link=new_link,
                         seen=[v[g] for v in b.seen] + [b.waker[g]])


def wait_chains(
    waits: pd.DataFrame,
    states: pd.DataFrame,
    run_split: RunSplit,
    *,
    pipeline_tids: tuple[int, ...] = (),
    n_cpus: int = 1,
    max_depth: int = MAX_DEPTH,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Follow the `waits` (columns wait, tid, start_ns, end_ns, waker_tid, state: the
    blocked part [start_ns, end_ns) ended by waker_tid) through `states` (every thread's
    attributed states, sorted by (tid, start_ns): intervals or slots, with futex_class).
    Returns (links, ends).

    A waker that sat runnable was still producing as far as the CPUs were busy with the
    pipeline itself (`pipeline_tids`: trainer, data loaders): that share of its runnable
    time counts as input_pipeline, the rest (CPUs taken by others) as cpu_contention.
    The share is the other pipeline threads' running time in the window over what the
    `n_cpus` CPUs could run while the waker was queued, at most 1: it assumes they ran
    while it waited, which errs towards input_pipeline."""
    walk = _Walk(states, run_split, pipeline_tids, n_cpus)
    wait, tid = waits["wait"].to_numpy(np.int64), waits["tid"].to_numpy(np.int64)
    if len(waits):
        walk.link(wait, 0, tid, np.asarray(waits["state"], dtype=object), np.full(len(waits), -1, dtype=np.int64))
    b: _Branches | None = _Branches(
        wait=wait, a=waits["start_ns"].to_numpy(np.int64), t=waits["end_ns"].to_numpy(np.int64),
        waker=waits["waker_tid"].to_numpy(np.int64), weight=np.ones(len(waits)),
        link=np.arange(len(waits), dtype=np.int64), seen=[tid])
    for depth in range(1, max_depth + 1):
        if b is None or not len(b.wait):
            break
        b = walk.step(b, depth, max_depth)
    return _table(LINK_COLUMNS, walk.links, sort=False), _table(END_COLUMNS, walk.ends, sort=True)
