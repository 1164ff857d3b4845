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
from trainbpf.analyzers.vocab import (
    FOLLOWED_STATES,
    FUTEX_CLASSES,
    FUTEX_CODE,
    RUN_CLASSES,
    STATE_CODE,
    STATES,
    codes,
)
from trainbpf.analyzers.intervals import ClassTime, thread_ranges
from trainbpf.analyzers.threads.states import BLOCKED_PART, PART_CODES, SLOT_EDGES, as_slots

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
    links: list[dict] = []
    ends: list[dict] = []
    n_links = 0
    if len(waits):
        n_links = len(waits)
        links.append({"wait": waits["wait"].to_numpy(np.int64), "depth": 0,
                      "tid": waits["tid"].to_numpy(np.int64), "state": np.asarray(waits["state"], dtype=object),
                      "parent": np.full(n_links, -1, dtype=np.int64)})
    slots = as_slots(states)
    spans = thread_ranges(slots["tid"].to_numpy())
    cache: dict[int, _Thread] = {}
    edges = [slots[name].to_numpy() for name in SLOT_EDGES]
    st_state, st_fclass = codes(slots["state"]), codes(slots["futex_class"])
    st_waker = slots["waker_tid"].to_numpy()
    state_names = np.asarray(STATES, dtype=object)
    category_names = np.asarray(CATEGORIES, dtype=object)
    run_category = np.asarray([RUN_CATEGORY[c] for c in RUN_CLASSES], dtype=object)

    def thread(tid: int) -> _Thread | None:
        """The thread's index; None for a thread with no time in its states (untraced)."""
        if tid not in cache:
            lo, hi = spans.get(tid, (0, 0))
            if hi == lo or edges[0][lo] == edges[-1][hi - 1]:
                return None
            cache[tid] = _Thread([e[lo:hi] for e in edges], st_state[lo:hi], st_fclass[lo:hi], st_waker[lo:hi])
        return cache[tid]

    def pipeline_running(a: np.ndarray, t: np.ndarray) -> dict[int, np.ndarray]:
        """ns each traced pipeline thread ran inside each [a, t)."""
        running = {}
        for p in pipeline_tids:  # a loop over threads
            th = thread(int(p))
            if th is not None:
                running[int(p)] = th.time.between(a, t)[:, _RUNNING]
        return running

    def end(wait, depth, tid, state, category, weight, link, cycle=False) -> None:
        """Record where a share of some waits ended (scalars broadcast over the waits)."""
        keep = np.asarray(weight) > MIN_WEIGHT
        if keep.any():
            def each(value):
                return np.broadcast_to(np.asarray(value, dtype=object if isinstance(value, str) else None), keep.shape)[keep]

            ends.append({"wait": wait[keep], "depth": depth, "tid": each(tid), "state": each(state),
                         "category": each(category), "weight": np.asarray(weight, dtype=np.float64)[keep],
                         "cycle": each(cycle), "link": link[keep]})

    # The open branches: the wait they share out, the window [a, t) the waker's time is
    # looked at, the waker, the branch's weight, and its last link.
    wait = waits["wait"].to_numpy(np.int64)
    a, t = waits["start_ns"].to_numpy(np.int64), waits["end_ns"].to_numpy(np.int64)
    waker = waits["waker_tid"].to_numpy(np.int64)
    weight = np.ones(len(waits))
    link = np.arange(len(waits), dtype=np.int64)
    seen = [waits["tid"].to_numpy(np.int64)]  # tids on each open branch, one array per depth
    for depth in range(1, max_depth + 1):
        if not len(wait):
            break
        n = len(wait)
        # The waker's blocked intervals inside each window: (branch, start, end, state,
        # futex class, waker, overlap weight) per group of branches.
        children: list[tuple[np.ndarray, ...]] = []
        pipeline: tuple[dict[int, np.ndarray], np.ndarray] | None = None  # running ns, for every window here
        for w, idx in pd.Series(np.arange(n)).groupby(waker).indices.items():
            th = thread(int(w))
            if th is None:
                end(wait[idx], depth, w, "untraced", "other", weight[idx], link[idx])
                continue
            times = th.time.between(a[idx], t[idx]).astype(np.float64)
            total = times.sum(axis=1)
            times[total == 0, _RUNNING] = 1.0  # a zero-length wait: the waker ran
            scale = weight[idx] / np.maximum(times.sum(axis=1), 1.0)
            run = scale * times[:, _RUNNING]
            split = run_split.fractions(int(w), a[idx], t[idx])
            for k in range(len(RUN_CLASSES)):
                end(wait[idx], depth, w, "running", run_category[k], run * split[:, k], link[idx])
            queued = scale * times[:, _RUNNABLE]
            if (queued > MIN_WEIGHT).any():
                if pipeline is None:
                    running = pipeline_running(a, t)
                    pipeline = running, sum(running.values(), np.zeros(n, np.int64))
                running, busy = pipeline
                # The other pipeline threads' running time (integer ns: exact however summed).
                others = busy[idx] - running[int(w)][idx] if int(w) in running else busy[idx]
                queued_ns = np.maximum(times[:, _RUNNABLE], 1.0)
                own = np.clip(others / (max(n_cpus, 1) * queued_ns), 0.0, 1.0)
                end(wait[idx], depth, w, "runnable", "input_pipeline", queued * own, link[idx])
                end(wait[idx], depth, w, "runnable", "cpu_contention", queued * (1.0 - own), link[idx])
            window, *blocked = th.blocked_within(a[idx], t[idx])
            if not len(window):
                continue
            branch = idx[window]
            overlap = np.minimum(blocked[1], t[branch]) - np.maximum(blocked[0], a[branch])
            children.append((branch, *blocked, scale[window] * np.maximum(overlap, 0)))
        if not children:
            break
        parent, c_start, c_end, c_state, c_fclass, c_waker, cw = (np.concatenate(c) for c in zip(*children))
        keep = cw > MIN_WEIGHT
        parent, c_start, c_end, c_state, c_fclass, c_waker, cw = (
            v[keep] for v in (parent, c_start, c_end, c_state, c_fclass, c_waker, cw)
        )
        follow = is_followed(c_state, c_fclass, c_waker)
        cycle = np.zeros(len(parent), dtype=bool)
        for prior in seen + [waker]:
            cycle |= follow & (c_waker == prior[parent])
        go = follow & ~cycle & (depth < max_depth)
        stop = ~go
        end(wait[parent[stop]], depth, waker[parent[stop]], state_names[c_state[stop]],
            category_names[interval_category_codes(c_state[stop], c_fclass[stop])],
            cw[stop], link[parent[stop]], cycle[stop])
        if go.any():
            g = parent[go]
            links.append({"wait": wait[g], "depth": depth, "tid": waker[g], "state": state_names[c_state[go]],
                          "parent": link[g]})
            new_link = n_links + np.arange(int(go.sum()), dtype=np.int64)
            n_links += int(go.sum())
        else:
            new_link = np.zeros(0, dtype=np.int64)
        seen = [v[parent[go]] for v in seen] + [waker[parent[go]]]
        # A branch goes on over the part of its window the waker spent in that interval.
        wait, a, t = wait[parent[go]], np.maximum(c_start[go], a[parent[go]]), np.minimum(c_end[go], t[parent[go]])
        waker, weight, link = c_waker[go], cw[go], new_link
    return _table(LINK_COLUMNS, links, sort=False), _table(END_COLUMNS, ends, sort=True)
