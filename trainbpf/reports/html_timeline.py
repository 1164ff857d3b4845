"""The HTML report's charts, drawn as inline SVG: the GPU-starvation timeline and the
CUDA tracks.

The timeline bins the analysed window into columns: each GPU's utilisation as a line on
top, with the starved time of each column (the idle time the trainer's stalls explain)
hanging above the line coloured by cause, and the samples below the renderer's GPU idle
threshold shaded; the trainer's state mix per column stacked underneath (for a job, a
lane per rank: its trainer's states and a strip of its own starved time by cause,
trainbpf/reports/html_job.py); then one row of marks per finding where its starved time falls.
With the CUDA probe's rows a second chart gives each thread that made CUDA calls a track
on the same columns: its GPU waits and launch gaps (the share of each column), and its
launches per column.  Colours of causes come from the category registry
(analyzers/causes/categories.py), the one table of them.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import BY_NAME, HOST_CATEGORY, REGISTRY
from trainbpf.analyzers.intervals import NS_PER_S, ClassTime, Span, intersect, merge_intervals
from trainbpf.analyzers.pipeline import Analysis
from trainbpf.analyzers.vocab import STATES
from trainbpf.reports.html_job import Lane, trainer_lanes

STATE_COLORS = {
    "running": "#2e9e44", "runnable": "#f29d38", "futex": "#8e6bd1", "sleep": "#8fc1e3",
    "page_faults": "#d64545", "mmap_lock": "#a0522d", "memory_reclaim": "#c2389a",
    "dirty_throttling": "#e8702a", "block_io": "#2f6db5", "network_io": "#0f8b8d", "uninterruptible": "#7a7a7a",
    "short_wait": "#c8c8c8", "other": "#4d4d4d",
}
# The timeline's row of host-bound time, in the colour of the trainer's own computation.
HOST_ROW = "host-bound"
HOST_COLOUR = BY_NAME["host_compute"].colour
WIDTH = 1200
LEFT = 150
RIGHT = 40
BINS = 400
MAX_CUDA_TRACKS = 16
# A rank's lane: its trainer's states over a strip of its starved time by cause.
RANK_STATE_H, RANK_STRIP_H, RANK_GAP = 26, 8, 6
CUDA_COLORS = {"cuda-wait": "#6a3d9a", "cuda-gap": "#ff7f0e", "cuda-launch": "#2ca02c"}


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def cause_colour(name: str) -> str:
    """A cause's colour (the registry's); the host-bound row's is host_compute's."""
    record = BY_NAME.get(name)
    return record.colour if record is not None else HOST_COLOUR


def idle_stretches(util: pd.DataFrame, *, threshold: float, window: Span) -> pd.DataFrame:
    """(start_ns, end_ns): merged stretches inside `window` where a GPU's utilisation
    (gpu.UTIL_COLUMNS rows) was below `threshold` percent, shaded on the timeline.
    Drawing only: starved time never depends on a threshold."""
    idle = util[util["util"] < threshold]
    start = np.clip(idle["start_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    end = np.clip(idle["ts_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    start, end = merge_intervals(start, end)
    return pd.DataFrame({"start_ns": start, "end_ns": end})


def _bins(analysis: Analysis, n: int = BINS) -> np.ndarray:
    w = analysis.window
    return np.linspace(w.start_ns, w.end_ns, n + 1).astype(np.int64)


def _x(ns: Any, analysis: Analysis, width: int) -> np.ndarray:
    w = analysis.window
    span = max(1, w.ns)
    return LEFT + (np.asarray(ns, dtype=np.float64) - w.start_ns) / span * (width - LEFT - RIGHT)


def trainer_state_mix(analysis: Analysis, edges: np.ndarray, tid: int | None) -> np.ndarray:
    """(bins, len(STATES)) ns the trainer `tid` spent in each state per bin."""
    st = analysis.states[analysis.states["tid"].to_numpy() == (tid if tid is not None else -2)]
    if not len(st):
        return np.zeros((len(edges) - 1, len(STATES)))
    index = ClassTime(st["start_ns"].to_numpy(), st["end_ns"].to_numpy(), st["state"].cat.codes.to_numpy(), len(STATES))
    cum = index.upto(edges)
    return np.diff(cum, axis=0).astype(np.float64)


def finding_bins(starved: pd.DataFrame, edges: np.ndarray) -> dict[str, np.ndarray]:
    """Starved ns per category per bin, each piece spread over the bins it spans."""
    st = starved
    start, end = st["start_ns"].to_numpy(np.int64), st["end_ns"].to_numpy(np.int64)
    ia, ib, s, e = intersect(start, end, edges[:-1], edges[1:])
    weight = st["ns"].to_numpy()[ia] * (e - s) / np.maximum(end - start, 1)[ia]
    cats = st["category"].astype(str).to_numpy(dtype=object)[ia]
    return {
        str(cat): np.bincount(ib[cats == cat], weights=weight[cats == cat], minlength=len(edges) - 1)
        for cat in np.unique(cats)
    }


def host_bins(analysis: Analysis, edges: np.ndarray) -> np.ndarray:
    """Host-bound ns per bin: the starved pieces of the trainer's own running time that
    its host work explains (data loading in its thread, other computation)."""
    st = analysis.starved
    host = ((st["state"] == "running").to_numpy() & (st["end"].to_numpy() < 0)
            & st["category"].astype(str).isin(list(HOST_CATEGORY.values())).to_numpy())
    start, end = st["start_ns"].to_numpy(np.int64)[host], st["end_ns"].to_numpy(np.int64)[host]
    ia, ib, s, e = intersect(start, end, edges[:-1], edges[1:])
    weight = st["ns"].to_numpy()[host][ia] * (e - s) / np.maximum(end - start, 1)[ia]
    return np.bincount(ib, weights=weight, minlength=len(edges) - 1)


def _marked(analysis: Analysis, report: dict[str, Any], edges: np.ndarray) -> tuple[list[str], dict[str, np.ndarray]]:
    """The rows of marks (the findings with starved time; first, with host work, the
    host-bound part of starved time, whatever finding it went to) and their ns per bin."""
    cats = [f["category"] for f in report["findings"] if f["seconds"] > 0]
    per_bin = finding_bins(analysis.starved, edges)
    if report["host_bound_s"] > 0:
        cats = [HOST_ROW] + cats
        per_bin[HOST_ROW] = host_bins(analysis, edges)
    return cats, per_bin


def timeline(analysis: Analysis, report: dict[str, Any], *, gpu_idle_threshold: float) -> str:
    """The GPU-starvation timeline; GPU samples below `gpu_idle_threshold` percent shaded."""
    edges = _bins(analysis)
    cats, per_bin_all = _marked(analysis, report, edges)
    gpu_h, state_h, mark_h, gap = 110, 54, 14, 18
    lanes = trainer_lanes(analysis)
    if analysis.job is not None:
        state_h = RANK_STATE_H + RANK_STRIP_H
    lanes_h = len(lanes) * state_h + (len(lanes) - 1) * RANK_GAP
    top = 10
    height = top + gpu_h + gap + lanes_h + gap + mark_h * max(1, len(cats)) + 34
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="GPU-starvation timeline" shape-rendering="crispEdges">']
    out.append(f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>')
    x0, x1 = LEFT, WIDTH - RIGHT
    # GPU lane: each GPU's utilisation as a line.  Above it lies each sample's idle part;
    # the starved time of each column hangs there from the top, coloured by cause, so the
    # idle time the trainer's stalls explain is coloured and the rest stays blank.
    xs = _x(edges, analysis, WIDTH)
    bw = np.diff(xs)
    width_ns = np.diff(edges).astype(np.float64)
    out.append(f'<text x="8" y="{top + 14}">GPU utilisation</text>')
    out.append(f'<rect x="{x0}" y="{top}" width="{x1 - x0}" height="{gpu_h}" fill="#fafafa" stroke="#ccc"/>')
    if analysis.basis == "gpu_idle":
        idle = idle_stretches(analysis.gpu, threshold=gpu_idle_threshold, window=analysis.window)
        for s, e in zip(_x(idle["start_ns"], analysis, WIDTH), _x(idle["end_ns"], analysis, WIDTH)):
            out.append(f'<rect x="{s:.1f}" y="{top}" width="{max(0.5, e - s):.1f}" height="{gpu_h}" fill="#f1f1f1"/>')
        # A job's starved time is every rank's, each against its own GPU: a share of them all.
        ranks = len(lanes) if analysis.job is not None else 1
        out += _cause_stack(per_bin_all, xs, width_ns * ranks, top, gpu_h, min_h=0.2, after=' fill-opacity="0.75"')
        for name, g in analysis.gpu.groupby("gpu", sort=False):
            g = g[(g["ts_ns"] > analysis.window.start_ns) & (g["start_ns"] < analysis.window.end_ns)]
            if not len(g):
                continue
            xy = _x(np.column_stack([np.maximum(g["start_ns"], analysis.window.start_ns), np.minimum(g["ts_ns"], analysis.window.end_ns)]).ravel(), analysis, WIDTH)
            ys = top + gpu_h - np.repeat(np.clip(g["util"].to_numpy(), 0, 100), 2) / 100.0 * gpu_h
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xy, ys))
            out.append(f'<polyline points="{pts}" fill="none" stroke="#111" stroke-width="1.3"><title>{esc(name)}</title></polyline>')
        out.append(f'<text x="8" y="{top + 30}" fill="#666">line: utilisation</text>')
        out.append(f'<text x="8" y="{top + 44}" fill="#666">colour: idle time</text>')
        out.append(f'<text x="8" y="{top + 58}" fill="#666">explained, by cause</text>')
        out.append(f'<text x="8" y="{top + 72}" fill="#666">grey: below {gpu_idle_threshold:g}%</text>')
    else:
        out.append(f'<text x="{x0 + 12}" y="{top + gpu_h / 2:.0f}">No GPU samples: starved time is the trainer\'s non-running time over the whole window.</text>')
    # Trainer state mix: the trainer's, or each rank's.
    y = top + gpu_h + gap
    for lane in lanes:
        out += _trainer_lane(analysis, lane, edges, y, state_h)
        y += state_h + RANK_GAP
    # Finding marks.
    y += gap - RANK_GAP
    for i, cat in enumerate(cats):
        yy = y + i * mark_h
        out.append(f'<text x="8" y="{yy + 10}">{esc(cat)}</text>')
        per_bin = per_bin_all.get(cat, np.zeros(len(edges) - 1))
        colour = cause_colour(cat)
        for b in np.flatnonzero(per_bin > 0):
            alpha = 0.25 + 0.75 * min(1.0, per_bin[b] / max(width_ns[b], 1.0))
            out.append(f'<rect x="{xs[b]:.1f}" y="{yy + 1}" width="{max(1.0, bw[b] + 0.5):.1f}" height="{mark_h - 3}" fill="{colour}" fill-opacity="{alpha:.2f}"/>')
    if not cats:
        out.append(f'<text x="8" y="{y + 10}" fill="#666">no findings to mark</text>')
    # Time axis.
    ay = height - 18
    out.append(f'<line x1="{x0}" x2="{x1}" y1="{ay}" y2="{ay}" stroke="#999"/>')
    offset = (analysis.window.start_ns - analysis.span.start_ns) / NS_PER_S
    for frac in np.linspace(0, 1, 9):
        x = x0 + frac * (x1 - x0)
        label = offset + frac * analysis.window.seconds
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{ay}" y2="{ay + 4}" stroke="#999"/>')
        out.append(f'<text x="{x:.1f}" y="{ay + 15}" text-anchor="middle">{label:.2f} s</text>')
    out.append("</svg>")
    return "\n".join(out)


def _cause_stack(per_bin: dict[str, np.ndarray], xs: np.ndarray, width_ns: np.ndarray, y: float, height: float, *,
                 min_h: float, before: str = "", after: str = "") -> list[str]:
    """Each cause's share of every column, stacked down from `y` in its colour."""
    out, bw, acc = [], np.diff(xs), np.zeros(len(xs) - 1)
    for cat in (c.name for c in REGISTRY if c.name in per_bin):
        h = np.minimum(per_bin[cat] / np.maximum(width_ns, 1.0), 1.0) * height
        for b in np.flatnonzero(h > min_h):
            out.append(f'<rect{before} x="{xs[b]:.1f}" y="{y + acc[b]:.1f}" width="{bw[b] + 0.3:.1f}" height="{h[b]:.1f}" '
                       f'fill="{cause_colour(cat)}"{after}/>')
        acc += h
    return out


def _trainer_lane(analysis: Analysis, lane: Lane, edges: np.ndarray, y: float, height: int) -> list[str]:
    """A trainer's state mix per column; a rank's over a strip of its own starved time,
    each cause's share of the column stacked in its colour."""
    xs = _x(edges, analysis, WIDTH)
    bw = np.diff(xs)
    state_h = height if lane.rank is None else RANK_STATE_H
    out = [f'<text x="8" y="{y + 14}">{esc(lane.label)}</text>']
    mix = trainer_state_mix(analysis, edges, lane.tid)
    total = mix.sum(axis=1)
    for b in np.flatnonzero(total > 0):
        acc = 0.0
        for k in np.flatnonzero(mix[b]):
            h = mix[b, k] / total[b] * state_h
            out.append(f'<rect x="{xs[b]:.1f}" y="{y + acc:.1f}" width="{bw[b] + 0.3:.1f}" height="{h:.1f}" fill="{STATE_COLORS[STATES[k]]}"/>')
            acc += h
    out.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{state_h}" fill="none" stroke="#ccc"/>')
    if lane.starved is None:
        return out
    out += _cause_stack(finding_bins(lane.starved, edges), xs, np.diff(edges).astype(np.float64), y + state_h,
                        RANK_STRIP_H, min_h=0.1, before=' class="starved"')
    return [f'<g class="rank-lane" data-rank="{lane.rank}" data-pid="{lane.pid}" data-tid="{lane.tid}">', *out, "</g>"]


def _per_bin_ns(start: np.ndarray, end: np.ndarray, edges: np.ndarray) -> np.ndarray:
    ia, ib, s, e = intersect(start, end, edges[:-1], edges[1:])
    return np.bincount(ib, weights=(e - s).astype(np.float64), minlength=len(edges) - 1)


def cuda_chart(analysis: Analysis, report: dict[str, Any]) -> str:
    """One track per CUDA thread (the first MAX_CUDA_TRACKS): per column its GPU waits
    (purple, from the top) and launch gaps (orange, under them) as shares of the column,
    and a launch lane whose marks darken with the launches issued in the column."""
    cuda, rows = analysis.cuda, report["cuda"]["threads"][:MAX_CUDA_TRACKS]
    edges = _bins(analysis)
    xs = _x(edges, analysis, WIDTH)
    bw, width_ns = np.diff(xs), np.maximum(np.diff(edges).astype(np.float64), 1.0)
    wait_h, launch_h, gap = 26, 8, 12
    height = 8 + len(rows) * (wait_h + launch_h + gap)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="CUDA tracks" shape-rendering="crispEdges">']
    for i, t in enumerate(rows):
        y = 4 + i * (wait_h + launch_h + gap)
        out.append(f'<g class="cuda-track" data-tid="{t["tid"]}"><text x="4" y="{y + 12}">{esc((t["comm"] or "?")[:16])} {t["tid"]}</text>')
        out.append(f'<text x="4" y="{y + 25}" fill="#666">waits · launches</text>')
        out.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH - LEFT - RIGHT}" height="{wait_h + launch_h}" fill="#fafafa" stroke="#ddd"/>')
        hang = np.zeros(len(edges) - 1)
        for cls, frame in (("cuda-wait", cuda.waits), ("cuda-gap", cuda.gaps)):
            mine = frame[frame["tid"].to_numpy(np.int64) == t["tid"]]
            h = np.minimum(_per_bin_ns(mine["start_ns"].to_numpy(np.int64), mine["end_ns"].to_numpy(np.int64), edges)
                           / width_ns, 1.0) * wait_h
            for b in np.flatnonzero(h > 0):
                out.append(f'<rect class="{cls}" x="{xs[b]:.1f}" y="{y + hang[b]:.1f}" width="{bw[b] + 0.3:.1f}" '
                           f'height="{max(h[b], 0.5):.1f}" fill="{CUDA_COLORS[cls]}"/>')
            hang = np.minimum(hang + h, wait_h)
        mine = cuda.bursts[cuda.bursts["tid"].to_numpy(np.int64) == t["tid"]]
        at = np.searchsorted(edges, mine["start_ns"].to_numpy(np.int64), side="right") - 1
        ok = (at >= 0) & (at < len(edges) - 1)
        count = np.bincount(at[ok], weights=mine["launches"].to_numpy(np.float64)[ok], minlength=len(edges) - 1)
        for b in np.flatnonzero(count > 0):
            alpha = 0.3 + 0.7 * count[b] / count.max()
            out.append(f'<rect class="cuda-launch" x="{xs[b]:.1f}" y="{y + wait_h}" width="{max(1.0, bw[b] + 0.3):.1f}" '
                       f'height="{launch_h}" fill="{CUDA_COLORS["cuda-launch"]}" fill-opacity="{alpha:.2f}"/>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)

