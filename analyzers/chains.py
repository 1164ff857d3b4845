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

from trainbpf.analyzers.attribution import RunSplit
from trainbpf.analyzers.categories import (
    CATEGORIES, CATEGORY_DTYPE, FOLLOWED_STATES, FUTEX_CLASSES, FUTEX_CODE, RUN_CLASSES, STATE_CATEGORY, STATE_CODE,
    STATES, codes,
)
from trainbpf.analyzers.intervals import ClassTime

MAX_DEPTH = 16
LINK_COLUMNS = ("wait", "depth", "tid", "state", "parent")
END_COLUMNS = ("wait", "depth", "tid", "state", "category", "weight", "cycle", "link")
# Shares smaller than this fraction of a wait are dropped.
MIN_WEIGHT = 1e-6

_RUNNING, _RUNNABLE, _BLOCKED = 0, 1, 2
# Running stall classes, as categories.
RUN_CATEGORY = {cls: ("input_pipeline" if cls == "user" else cls) for cls in RUN_CLASSES}


def interval_category(state: str, futex_class: str) -> str:
    """The category a blocked or runnable interval stands for when not followed further."""
    if state == "futex" and futex_class == "lock":
        return "lock_contention"
    if state == "futex" and futex_class == "gil":
        return "gil_contention"
    return STATE_CATEGORY.get(state, "other")


# interval_category for every (state code, futex class code).
_INTERVAL_CATEGORY = np.array(
    [[CATEGORIES.index(interval_category(s, f)) for f in FUTEX_CLASSES] for s in STATES], dtype=np.int8
)
_FOLLOWED = np.array([STATE_CODE[s] for s in FOLLOWED_STATES])
_HANDOFF = np.array([FUTEX_CODE["lock"], FUTEX_CODE["gil"]])


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


class _Thread:
    """One thread's states, indexed for window queries."""

    def __init__(self, rows: pd.DataFrame, base: int):
        state = codes(rows["state"])
        code = np.full(len(rows), _BLOCKED)
        code[state == STATE_CODE["running"]] = _RUNNING
        code[state == STATE_CODE["runnable"]] = _RUNNABLE
        self.time = ClassTime(rows["start_ns"].to_numpy(), rows["end_ns"].to_numpy(), code, 3)
        blocked = np.flatnonzero(code == _BLOCKED)
        # The intervals tile the thread's life: sorted by start, they are sorted by end too.
        self.blocked_start = rows["start_ns"].to_numpy(np.int64)[blocked]
        self.blocked_end = rows["end_ns"].to_numpy(np.int64)[blocked]
        self.blocked_row = blocked + base  # positions in the whole states frame

    def blocked_within(self, a: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per window [a, t): the first of its overlapping blocked intervals (an index into
        blocked_*) and how many there are."""
        lo = np.searchsorted(self.blocked_end, a, side="right")
        hi = np.searchsorted(self.blocked_start, t, side="left")
        return lo, np.maximum(hi - lo, 0)


def _table(columns: tuple[str, ...], parts: list[dict], *, sort: bool) -> pd.DataFrame:
    """Concatenate row groups into a frame with the fixed columns and dtypes."""
    out = pd.concat([pd.DataFrame(p) for p in parts], ignore_index=True) if parts else pd.DataFrame(
        {c: np.zeros(0) for c in columns}
    )
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
    attributed states, sorted by (tid, start_ns)).  Returns (links, ends).

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
    tids = states["tid"].to_numpy()
    spans = pd.Series(np.arange(len(states))).groupby(tids).agg(["min", "max"])
    cache: dict[int, _Thread] = {}
    st_state = codes(states["state"])
    st_fclass = codes(states["futex_class"])
    st_waker = states["waker_tid"].to_numpy(np.int64)
    st_start = states["start_ns"].to_numpy(np.int64)
    st_end = states["end_ns"].to_numpy(np.int64)
    state_names = np.asarray(STATES, dtype=object)
    category_names = np.asarray(CATEGORIES, dtype=object)
    run_category = np.asarray([RUN_CATEGORY[c] for c in RUN_CLASSES], dtype=object)

    def thread(tid: int) -> _Thread | None:
        if tid not in cache:
            if tid not in spans.index:
                return None
            lo, hi = spans.loc[tid]
            cache[tid] = _Thread(states.iloc[lo : hi + 1], int(lo))
        return cache[tid]

    def pipeline_busy(a: np.ndarray, t: np.ndarray, waker: int) -> np.ndarray:
        """ns the pipeline's other threads ran inside each [a, t)."""
        busy = np.zeros(len(a))
        for p in pipeline_tids:  # a loop over threads
            th = thread(int(p)) if p != waker else None
            if th is not None:
                busy += th.time.between(a, t)[:, _RUNNING]
        return busy

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
        # The waker's blocked intervals inside each window, as (branch, states row, overlap weight).
        child_branch: list[np.ndarray] = []
        child_row: list[np.ndarray] = []
        child_weight: list[np.ndarray] = []
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
                queued_ns = np.maximum(times[:, _RUNNABLE], 1.0)
                own = np.clip(pipeline_busy(a[idx], t[idx], int(w)) / (max(n_cpus, 1) * queued_ns), 0.0, 1.0)
                end(wait[idx], depth, w, "runnable", "input_pipeline", queued * own, link[idx])
                end(wait[idx], depth, w, "runnable", "cpu_contention", queued * (1.0 - own), link[idx])
            lo, count = th.blocked_within(a[idx], t[idx])
            if not count.any():
                continue
            branch = np.repeat(idx, count)
            at = np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
            overlap = (np.minimum(th.blocked_end[at], t[branch]) - np.maximum(th.blocked_start[at], a[branch]))
            child_branch.append(branch)
            child_row.append(th.blocked_row[at])
            child_weight.append(np.repeat(scale, count) * np.maximum(overlap, 0))
        if not child_branch:
            break
        parent = np.concatenate(child_branch)
        r = np.concatenate(child_row)
        cw = np.concatenate(child_weight)
        keep = cw > MIN_WEIGHT
        parent, r, cw = parent[keep], r[keep], cw[keep]
        follow = is_followed(st_state[r], st_fclass[r], st_waker[r])
        cycle = np.zeros(len(r), dtype=bool)
        for prior in seen + [waker]:
            cycle |= follow & (st_waker[r] == prior[parent])
        go = follow & ~cycle & (depth < max_depth)
        stop = ~go
        end(wait[parent[stop]], depth, waker[parent[stop]], state_names[st_state[r[stop]]],
            category_names[interval_category_codes(st_state[r[stop]], st_fclass[r[stop]])],
            cw[stop], link[parent[stop]], cycle[stop])
        if go.any():
            g = parent[go]
            links.append({"wait": wait[g], "depth": depth, "tid": waker[g], "state": state_names[st_state[r[go]]],
                          "parent": link[g]})
            new_link = n_links + np.arange(int(go.sum()), dtype=np.int64)
            n_links += int(go.sum())
        else:
            new_link = np.zeros(0, dtype=np.int64)
        seen = [v[parent[go]] for v in seen] + [waker[parent[go]]]
        # A branch goes on over the part of its window the waker spent in that interval.
        wait, a, t = wait[parent[go]], np.maximum(st_start[r[go]], a[parent[go]]), np.minimum(st_end[r[go]], t[parent[go]])
        waker, weight, link = st_waker[r[go]], cw[go], new_link
    return _table(LINK_COLUMNS, links, sort=False), _table(END_COLUMNS, ends, sort=True)
