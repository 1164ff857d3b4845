"""The Python frames at both ends of a finding: the waiting thread's and the producer's.

- The waiter is the trainer.  Its stack is the Python stack it held most of the finding's
  starved time: a wait's pieces count under the stack taken at the wait's switch-out
  (`pystack_id` of its slot, also where it resumed); a running piece's time is shared
  among the trainer's on-CPU samples inside it.
- The producer is the thread at the far end of the finding's dominant chain (none when
  the chain is the trainer alone).  Its stack is what it was doing inside the trainer's
  waits that ended with it: for a producer that was running (input_pipeline, the
  on-CPU categories), the Python stack most of its on-CPU samples inside those waits
  show, which names the code that was still producing the data (`decode_batch`), not
  the hand-over that ended the wait (`Queue.put`); for one that was itself blocked
  (trainer <- worker <- dirty_throttling), its stack at the switch-out of its blocked
  intervals there, weighted by their overlap.  Where neither has a Python stack (a wait
  too short for a sample), its Python stack at the wake-ups it made inside those waits
  (`peer_pystack_id`).

A trace without any Python stack (version 1, or recorded without the walk) gives None,
so its findings' evidence is what it always was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import RUN_CATEGORY
from trainbpf.analyzers.causes.stack_reading import python_frame, stack_frames
from trainbpf.analyzers.intervals import intersect

if TYPE_CHECKING:
    from trainbpf.analyzers.causes.evidence import EvidenceContext

# Python frames a finding's evidence names at each end, leaf first (the recorder takes
# at most 16).
MAX_PYTHON_FRAMES = 16
# Categories findings.attribute_starved moves time into from a run class's own category
# (a churning thread's faults are allocator churn).
REFINED_FROM = {"allocator_churn": ("page_faults",)}


def python_frames(ctx: EvidenceContext, category: str, pieces: pd.DataFrame, chain: list[dict[str, Any]],
                  trainer_tid: int) -> dict[str, list[dict[str, Any]]] | None:
    """{"waiter": frames, "producer": frames} for a finding of `category`: its starved
    `pieces` (findings.ATTRIBUTED_COLUMNS) and dominant `chain`; each frame {"function", "file",
    "line"}, leaf first, [] where unknown; None when the trace has no Python stacks."""
    if not len(ctx.pystacks):
        return None
    waiter = _frames(ctx, _waiter_stack(ctx, pieces, trainer_tid, category))
    producer: list[dict[str, Any]] = []
    if len(chain) > 1 and int(chain[-1]["tid"]) != trainer_tid:
        end = chain[-1]
        producer = _frames(ctx, _producer_stack(ctx, pieces, int(end["tid"]), str(end["state"])))
    return {"waiter": waiter, "producer": producer}


def no_python_frames(ctx: EvidenceContext) -> dict[str, list[dict[str, Any]]] | None:
    """python_frames of a finding without starved time: both ends unknown."""
    return {"waiter": [], "producer": []} if len(ctx.pystacks) else None


def _frames(ctx: EvidenceContext, stack_id: int) -> list[dict[str, Any]]:
    if stack_id < 0:
        return []
    return [python_frame(f) for f in stack_frames(ctx.pystacks, stack_id)[:MAX_PYTHON_FRAMES]]


def _heaviest(ids: np.ndarray, weights: np.ndarray) -> int:
    """The id (>= 0) with the largest total weight, -1 if none; ties to the smallest id."""
    known = (ids >= 0) & (weights > 0)
    if not known.any():
        return -1
    total = pd.Series(weights[known]).groupby(ids[known]).sum()
    return int(total.index[np.argmax(total.to_numpy())])


def _thread_samples(ctx: EvidenceContext, tid: int, category: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ts_ns, pystack_id) of `tid`'s on-CPU samples that have a Python stack, by time;
    with `category`, those of its run classes when there are any."""
    s = ctx.samples
    if s is None or "pystack_id" not in s or not len(s):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keep = (s["tid"].to_numpy(np.int64) == tid) & (s["pystack_id"].to_numpy(np.int64) >= 0)
    if category is not None:
        named = s["cls"].astype(str).map(RUN_CATEGORY)
        of_category = keep & named.isin({category, *REFINED_FROM.get(category, ())}).to_numpy()
        keep = of_category if of_category.any() else keep
    return s["ts_ns"].to_numpy(np.int64)[keep], s["pystack_id"].to_numpy(np.int64)[keep]


def _samples_within(ts: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted sample times `ts` and disjoint windows sorted by start: (window, sample)
    position pairs of the samples inside each window."""
    lo, hi = np.searchsorted(ts, start, side="left"), np.searchsorted(ts, end, side="left")
    count = np.maximum(hi - lo, 0)
    window = np.repeat(np.arange(len(start)), count)
    sample = np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    return window, sample


def _waiter_stack(ctx: EvidenceContext, pieces: pd.DataFrame, trainer: int, category: str) -> int:
    if not len(pieces):
        return -1
    ts = ctx.trainer_states
    iv = pieces["interval"].to_numpy(np.int64)
    ns = pieces["ns"].to_numpy(np.float64)
    running = (pieces["state"] == "running").to_numpy()
    ids = [ts["pystack_id"].to_numpy(np.int64)[iv[~running]]]
    weights = [ns[~running]]
    if running.any():
        sample_ts, sample_ids = _thread_samples(ctx, trainer, category)
        start, end = pieces["start_ns"].to_numpy(np.int64)[running], pieces["end_ns"].to_numpy(np.int64)[running]
        order = np.argsort(start, kind="stable")
        piece, sample = _samples_within(sample_ts, start[order], end[order])
        per = np.bincount(piece, minlength=len(order))
        ids.append(sample_ids[sample])
        weights.append(ns[running][order][piece] / np.maximum(per[piece], 1))
    return _heaviest(np.concatenate(ids), np.concatenate(weights))


def _producer_stack(ctx: EvidenceContext, pieces: pd.DataFrame, tid: int, state: str) -> int:
    ts = ctx.trainer_states
    waits = np.unique(pieces.loc[(pieces["root_tid"] == tid).to_numpy(), "interval"].to_numpy(np.int64))
    if not len(waits):
        return -1
    start, end = ts["start_ns"].to_numpy(np.int64)[waits], ts["end_ns"].to_numpy(np.int64)[waits]
    slots = ctx.slots
    if state.startswith("running"):
        sample_ts, sample_ids = _thread_samples(ctx, tid)
        _, sample = _samples_within(sample_ts, start, end)
        found = _heaviest(sample_ids[sample], np.ones(len(sample)))
    else:
        lo, hi = np.searchsorted(slots["tid"].to_numpy(), [tid, tid + 1])
        mine = slots.iloc[lo:hi]
        ia, _, s, e = intersect(mine["switch_out_ns"].to_numpy(np.int64), mine["end_ns"].to_numpy(np.int64), start, end)
        found = _heaviest(mine["pystack_id"].to_numpy(np.int64)[ia], (e - s).astype(np.float64))
    if found >= 0:
        return found
    # The producer's stack at its wake-ups of any thread inside those waits.
    woke = np.flatnonzero(slots["waker_tid"].to_numpy(np.int64) == tid)
    wake = slots["wake_ns"].to_numpy(np.int64)[woke]
    at = np.searchsorted(start, wake, side="right") - 1
    inside = (at >= 0) & (wake <= end[np.maximum(at, 0)])
    peer = slots["peer_pystack_id"].to_numpy(np.int64)[woke[inside]]
    return _heaviest(peer, np.ones(len(peer)))
