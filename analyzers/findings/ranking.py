"""From attributed starved time to ranked findings.

Every starved piece carries exactly one category, so the shares of distinct findings
(category ns / starved ns) never add up to more than 1.  Two refinements move time
between categories on evidence about the thread at the root of a piece's chain: faults of
a thread that churns mappings are allocator churn, and data production on a thread that
mostly ran on a node other than the GPU's is (in that proportion) remote NUMA.

A finding is numbers and names (share, seconds, severity, threads, chain, evidence, and
with the CUDA probe's rows the seconds of launch gap it explains); the report layer writes its summary and recommendation from the category's record
(analyzers/causes/categories.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import (
    BY_NAME,
    CATEGORIES,
    CATEGORY_CODE,
    CATEGORY_DTYPE,
    HOST_CATEGORY,
    RUN_CATEGORY,
)
from trainbpf.analyzers.causes.chains import interval_category_codes, is_followed
from trainbpf.analyzers.causes.evidence import (
    MAX_THREADS,
    EvidenceContext,
    contenders,
    numa_placement,
    trainer_waits,
)
from trainbpf.analyzers.causes.numa import REMOTE_MIN_FRACTION, copies_remote
from trainbpf.analyzers.findings.python_ends import no_python_frames, python_frames
from trainbpf.analyzers.intervals import NS_PER_S, run_parallel
from trainbpf.analyzers.timeline.cuda_calls import in_gaps_ns
from trainbpf.analyzers.vocab import HOST_CLASSES, RUN_CLASSES, STATE_DTYPE, codes

# Severity: share of starved time, and how much of the analysed window that time is
# (a large share of a few stray milliseconds is not worth fixing first).
CRITICAL_SHARE = 0.25
WARNING_SHARE = 0.05
CRITICAL_MIN_IMPACT = 0.05
WARNING_MIN_IMPACT = 0.01
# Categories explaining less starved time than this are noise, not findings.
MIN_FINDING_NS = 1_000_000

# RUN_CLASS_DTYPE code -> CATEGORY code (code 0, not running, is never looked up).
_RUN_CLASS_CATEGORY = np.array([0] + [CATEGORIES.index(RUN_CATEGORY[c]) for c in RUN_CLASSES]
                               + [CATEGORIES.index(HOST_CATEGORY[c]) for c in HOST_CLASSES], dtype=np.int8)
# interval: the trainer state interval (position among its states) the piece lies in;
# end: the row of the chain ends that shared it out, -1 for pieces not followed.
ATTRIBUTED_COLUMNS = ("start_ns", "end_ns", "ns", "state", "category", "root_tid", "interval", "end")
# launch_gap_s: the finding's starved seconds inside the trainer's launch gaps (from the
# end of a GPU wait to its next launch); NaN when CUDA was not traced.
FINDING_COLUMNS = ("category", "share", "seconds", "severity", "threads", "chain", "evidence", "launch_gap_s")


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


def severity(share: float, seconds: float, window_s: float, category: str) -> str:
    impact = seconds / window_s if window_s > 0 else 0.0
    record = BY_NAME[category]
    min_impact = CRITICAL_MIN_IMPACT if record.critical_min_impact is None else record.critical_min_impact
    if record.critical and share >= CRITICAL_SHARE and impact >= min_impact:
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
    attributed: pd.DataFrame, links: pd.DataFrame, ends: pd.DataFrame, ctx: EvidenceContext, *, trainer_tid: int | None,
    gaps: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """One finding per category with starved time (plus remote-NUMA placement seen
    without starved time, as info), sorted by share, largest first.  `gaps`: the
    trainer's launch gaps (cuda.GAP_COLUMNS), None when CUDA was not traced."""
    total = float(attributed["ns"].sum())
    window_s = ctx.window.seconds
    trainer = -1 if trainer_tid is None else int(trainer_tid)
    per_cat = attributed.groupby("category", observed=True)["ns"].sum()
    keys = chain_keys(links, ends)
    in_category = attributed.groupby("category", observed=True).indices

    def finding(category: str) -> dict[str, Any] | None:
        ns = float(per_cat.get(category, 0.0))
        if ns < MIN_FINDING_NS:
            if category == "numa_remote" and (copies_remote(ctx.copies) or len(ctx.placement) and (
                    ctx.placement["remote_fraction"] > REMOTE_MIN_FRACTION).any()):
                return _finding(category, 0.0, 0.0, window_s, [], [], _with(numa_placement(ctx, []), no_python_frames(ctx)),
                                ctx, float("nan") if gaps is None else 0.0)
            return None
        pieces = attributed.iloc[in_category[category]]
        by_root = pieces.groupby("root_tid")["ns"].sum().sort_values(ascending=False)
        roots = [int(t) for t in by_root.index]
        shown = roots + contenders(ctx, BY_NAME[category].futex_class, roots)
        share = min(1.0, ns / total) if total > 0 else 0.0
        chain = _dominant_chain(pieces, links, ends, keys, ctx, trainer)
        evidence = {"starved_s": ns / NS_PER_S, **trainer_waits(ctx, pieces), **BY_NAME[category].evidence(ctx, pieces, roots)}
        evidence = _with(evidence, python_frames(ctx, category, pieces, chain, trainer))
        gap_s = float("nan") if gaps is None else float(in_gaps_ns(pieces, gaps).sum()) / NS_PER_S
        return _finding(category, share, ns / NS_PER_S, window_s, shown[:MAX_THREADS], chain, evidence, ctx, gap_s)

    # The categories' evidence is independent: gathered side by side.
    rows = [row for row in run_parallel([partial(finding, c) for c in CATEGORIES]) if row is not None]
    if not rows:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in FINDING_COLUMNS}).astype(
            {"share": np.float64, "seconds": np.float64, "launch_gap_s": np.float64}
        )
    out = pd.DataFrame(rows, columns=list(FINDING_COLUMNS))
    out["share"] = out["share"].astype(np.float64)
    out["seconds"] = out["seconds"].astype(np.float64)
    out["launch_gap_s"] = out["launch_gap_s"].astype(np.float64)
    return out.sort_values(["share", "seconds"], ascending=False, kind="stable").reset_index(drop=True)


def _with(evidence: dict[str, Any], frames: dict[str, Any] | None) -> dict[str, Any]:
    """Evidence with `python_frames` when the trace has Python stacks (frames not None)."""
    return evidence if frames is None else {**evidence, "python_frames": frames}


def _finding(
    category: str, share: float, seconds: float, window_s: float, roots: list[int], chain: list[dict[str, Any]],
    evidence: dict[str, Any], ctx: EvidenceContext, launch_gap_s: float,
) -> dict[str, Any]:
    """A finding's row; a finding without starved time (numa_remote placement alone)
    names the remote threads."""
    threads = [ctx.thread(t) for t in roots] or [
        ctx.thread(int(t["tid"])) for t in evidence.get("remote_threads", [])
    ]
    return {
        "category": category, "share": share, "seconds": seconds,
        "severity": severity(share, seconds, window_s, category), "threads": threads, "chain": chain,
        "evidence": evidence, "launch_gap_s": launch_gap_s,
    }
