"""Wake-up chains: whom a wait was waiting for, and what that thread was doing meanwhile.

For a wait [a, t) ended by waker W at t, W's time inside [a, t) decides: mostly running
means the awaited thing was still being produced (input_pipeline, or the stall class its
on-CPU samples show); mostly runnable means W could not get a CPU (cpu_contention); mostly
blocked means W was itself waiting, and the chain continues with W's last blocked interval
before t.  One vectorised step per chain depth, over all open chains at once; a chain
stops at a cause that is not followed, at a waker seen before in the same chain (a cycle),
at an untraced waker, or at MAX_DEPTH.
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
CHAIN_COLUMNS = ("wait", "depth", "tid", "state", "category", "cycle")

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


class _Thread:
    """One thread's states, indexed for window queries."""

    def __init__(self, rows: pd.DataFrame, base: int):
        state = codes(rows["state"])
        code = np.full(len(rows), _BLOCKED)
        code[state == STATE_CODE["running"]] = _RUNNING
        code[state == STATE_CODE["runnable"]] = _RUNNABLE
        self.time = ClassTime(rows["start_ns"].to_numpy(), rows["end_ns"].to_numpy(), code, 3)
        blocked = np.flatnonzero(code == _BLOCKED)
        self.blocked_start = rows["start_ns"].to_numpy()[blocked]
        self.blocked_end = rows["end_ns"].to_numpy()[blocked]
        self.blocked_row = blocked + base  # positions in the whole states frame


def wait_chains(
    waits: pd.DataFrame, states: pd.DataFrame, run_split: RunSplit, *, max_depth: int = MAX_DEPTH
) -> pd.DataFrame:
    """Chains of the followed `waits` (columns wait, tid, start_ns, end_ns, waker_tid: the
    blocked part [start_ns, end_ns) ended by waker_tid).  `states` is every thread's
    attributed states sorted by (tid, start_ns).  One row per link; depth 0 is the waiter,
    the last link of a wait names the category, which every link of it carries."""
    links: list[pd.DataFrame] = []
    if len(waits):
        links.append(pd.DataFrame({
            "wait": waits["wait"].to_numpy(np.int64), "depth": 0,
            "tid": waits["tid"].to_numpy(np.int64), "state": np.asarray(waits["state"], dtype=object),
            "category": None, "cycle": False,
        }))
    tids = states["tid"].to_numpy()
    spans = pd.Series(np.arange(len(states))).groupby(tids).agg(["min", "max"])
    cache: dict[int, _Thread] = {}
    st_state = codes(states["state"])
    st_fclass = codes(states["futex_class"])
    st_waker = states["waker_tid"].to_numpy(np.int64)
    st_start = states["start_ns"].to_numpy(np.int64)
    st_end = states["end_ns"].to_numpy(np.int64)

    def thread(tid: int) -> _Thread | None:
        if tid not in cache:
            if tid not in spans.index:
                return None
            lo, hi = spans.loc[tid]
            cache[tid] = _Thread(states.iloc[lo : hi + 1], int(lo))
        return cache[tid]

    frontier = pd.DataFrame({
        "wait": waits["wait"].to_numpy(np.int64), "a": waits["start_ns"].to_numpy(np.int64),
        "t": waits["end_ns"].to_numpy(np.int64), "waker": waits["waker_tid"].to_numpy(np.int64),
    })
    seen = {0: waits["tid"].to_numpy(np.int64)}  # depth -> tid per frontier row, aligned
    for depth in range(1, max_depth + 1):
        if not len(frontier):
            break
        n = len(frontier)
        state = np.empty(n, dtype=object)
        category = np.empty(n, dtype=object)
        next_row = np.full(n, -1, dtype=np.int64)
        waker = frontier["waker"].to_numpy()
        a, t = frontier["a"].to_numpy(), frontier["t"].to_numpy()
        for w, idx in pd.Series(np.arange(n)).groupby(waker).indices.items():
            th = thread(int(w))
            if th is None:
                state[idx], category[idx] = "untraced", "other"
                continue
            times = th.time.between(a[idx], t[idx])
            mode = np.argmax(times[:, [_RUNNING, _RUNNABLE, _BLOCKED]], axis=1)
            mode[times.sum(axis=1) == 0] = _RUNNING  # a zero-length wait: the waker ran
            run = idx[mode == _RUNNING]
            if len(run):
                frac = run_split.fractions(int(w), a[run], t[run])
                cls = np.asarray(RUN_CLASSES, dtype=object)[np.argmax(frac, axis=1)]
                state[run] = "running"
                category[run] = [RUN_CATEGORY[c] for c in cls]
            rq = idx[mode == _RUNNABLE]
            state[rq], category[rq] = "runnable", "cpu_contention"
            blk = idx[mode == _BLOCKED]
            if len(blk):
                # The waker's last blocked interval that began before the wake-up.
                pos = np.searchsorted(th.blocked_start, t[blk], side="left") - 1
                valid = pos >= 0
                rows = np.where(valid, th.blocked_row[np.maximum(pos, 0)], -1)
                state[blk] = np.where(valid, np.asarray(STATES, dtype=object)[st_state[np.maximum(rows, 0)]], "other")
                category[blk] = "other"
                next_row[blk] = rows
        # Which blocked links continue: followed causes whose waker is not already in the chain.
        has_row = next_row >= 0
        r = np.maximum(next_row, 0)
        follow = has_row & is_followed(st_state[r], st_fclass[r], st_waker[r])
        cycle = np.zeros(n, dtype=bool)
        for prior in seen.values():
            cycle |= follow & (st_waker[r] == prior)
        cycle |= follow & (st_waker[r] == waker)
        stop_here = has_row & ~(follow & ~cycle)
        category[stop_here] = np.asarray(CATEGORIES, dtype=object)[
            interval_category_codes(st_state[r[stop_here]], st_fclass[r[stop_here]])
        ]
        links.append(pd.DataFrame({
            "wait": frontier["wait"].to_numpy(), "depth": depth, "tid": waker,
            "state": state, "category": category, "cycle": cycle,
        }))
        go = follow & ~cycle & (depth < max_depth)
        seen = {d: v[go] for d, v in seen.items()}
        seen[depth] = waker[go]
        frontier = pd.DataFrame({
            "wait": frontier["wait"].to_numpy()[go], "a": st_start[r[go]],
            "t": st_end[r[go]], "waker": st_waker[r[go]],
        })
    if not links:
        return pd.DataFrame({
            "wait": np.zeros(0, np.int64), "depth": np.zeros(0, np.int64), "tid": np.zeros(0, np.int64),
            "state": pd.Series([], dtype=str), "category": pd.Categorical([], dtype=CATEGORY_DTYPE),
            "cycle": np.zeros(0, bool),
        })
    out = pd.concat(links, ignore_index=True)
    final = out.dropna(subset=["category"]).drop_duplicates("wait", keep="last").set_index("wait")["category"]
    out["category"] = pd.Categorical(out["wait"].map(final).fillna("other").to_numpy(dtype=object), dtype=CATEGORY_DTYPE)
    out["state"] = out["state"].astype(str)
    out["depth"] = out["depth"].astype(np.int64)
    out["tid"] = out["tid"].astype(np.int64)
    out["cycle"] = out["cycle"].astype(bool)
    return out.sort_values(["wait", "depth"], kind="stable")[list(CHAIN_COLUMNS)].reset_index(drop=True)
