"""Several traces of one job on one clock (docs/findings.md, "Several nodes").

Each trace's times are its node's CLOCK_MONOTONIC; its metadata's wall_minus_mono_ns
puts them on the wall clock, as well as that node's clock was synchronised (NTP leaves
milliseconds, a badly set node more).  All ranks leave a collective within the
network's latency of each other, so the exits of a trace's collectives, set against a
reference trace's, show what is left: of every pair of exits less than SEARCH_NS apart
on the wall clock, the differences pile up at the residual offset (a step's length
varies from step to step, so the pairs one step apart spread out).  The fullest
BIN_NS bin (with its neighbours) gives the matched pairs, and their median the
residual.  A trace whose exits mostly find no partner there keeps its wall clock."""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.job.collectives import exit_clusters, exit_tolerance

# Residuals are looked for within this much of the wall-clock alignment ...
SEARCH_NS = 1_000_000_000
# ... in bins this wide (a few times the exits' spread across ranks).
BIN_NS = 500_000
# At least this share of the smaller trace's exits must match for the residual to count.
MIN_MATCHED_SHARE = 0.5
# A residual above this is worth a warning: that node's clock is badly synchronised.
WARN_RESIDUAL_NS = 5_000_000
ALIGN_COLUMNS = ("offset_ns", "residual_ns", "aligned_by", "matched", "exits")


def trace_exits(calls: pd.DataFrame) -> np.ndarray:
    """One exit per collective of a trace's own ranks (calls: CALL_COLUMNS, its clock):
    their exits clustered as collectives.match_collectives clusters them, each
    cluster's last, sorted."""
    exits = np.sort(calls["exit_ns"].to_numpy(np.int64))
    if not len(exits):
        return exits
    cluster = exit_clusters(exits, exit_tolerance(calls))
    return exits[np.append(cluster[1:] != cluster[:-1], True)]


def residual(exits: np.ndarray, reference: np.ndarray) -> tuple[int, int]:
    """(residual ns to add to `exits` to meet `reference`, how many of `exits` matched
    one of the reference's there); both sorted, on the wall clock.  (0, 0) when no
    pair lies within SEARCH_NS."""
    lo = np.searchsorted(reference, exits - SEARCH_NS, side="left")
    hi = np.searchsorted(reference, exits + SEARCH_NS, side="right")
    count = hi - lo
    if not count.sum():
        return 0, 0
    mine = np.repeat(np.arange(len(exits)), count)
    theirs = np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    diffs = reference[theirs] - exits[mine]
    edges = np.arange(-SEARCH_NS, SEARCH_NS + BIN_NS, BIN_NS)
    hist, _ = np.histogram(diffs, bins=edges)
    near = np.convolve(hist, np.ones(3, np.int64), mode="same")  # a peak split over two bins counts whole
    peak = int(np.argmax(near))
    inside = (diffs >= edges[max(peak - 1, 0)]) & (diffs < edges[min(peak + 2, len(edges) - 1)])
    return int(np.median(diffs[inside])), int(len(np.unique(mine[inside])))


def align_traces(exits: list[np.ndarray], wall_minus_mono: list[int]) -> pd.DataFrame:
    """ALIGN_COLUMNS per trace: `offset_ns` takes its times onto the first trace's clock
    (its time + offset_ns); `residual_ns` is the part of it the collectives gave beyond
    the wall clocks, `aligned_by` "collectives", "wall clock" (too few exits matched:
    the residual is 0) or "reference" (the first trace), `matched` and `exits` the
    counts.  `exits`: each trace's
    (trace_exits, its clock); `wall_minus_mono`: each trace's metadata offset."""
    rows = []
    reference = np.sort(exits[0] + wall_minus_mono[0]) if exits else np.zeros(0, np.int64)
    for i, (mine, wall) in enumerate(zip(exits, wall_minus_mono)):
        shift, matched, by = 0, len(mine), "reference"
        if i:
            shift, matched = residual(np.sort(mine + wall), reference)
            by = "collectives"
            if not len(mine) or not len(reference) or matched < MIN_MATCHED_SHARE * min(len(mine), len(reference)):
                shift, by = 0, "wall clock"
        rows.append({"offset_ns": wall - wall_minus_mono[0] + shift, "residual_ns": shift, "aligned_by": by,
                     "matched": matched, "exits": len(mine)})
    return pd.DataFrame(rows, columns=list(ALIGN_COLUMNS))
