"""A self-contained HTML report: inline CSS and SVG drawn here, no scripts, no network.

The timeline bins the analysed window into columns: each GPU's utilisation as a line on
top, with the starved time of each column (the idle time the trainer's stalls explain)
hanging above the line coloured by cause; the trainer's state mix per column stacked
underneath (for a job, a lane per rank: its trainer's states and a strip of its own
starved time by cause, trainbpf/reports/html_job.py); then one row of marks per finding where its
starved time falls.  With the
CUDA probe's rows a second chart gives each thread that made CUDA calls a track on the
same columns: its GPU waits and launch gaps (the share of each column), and its launches
per column.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pandas as pd

from trainbpf.analyzers.pipeline import Analysis, observed_ns
from trainbpf.analyzers.causes.categories import HOST_CATEGORY, REGISTRY
from trainbpf.analyzers.intervals import NS_PER_S, ClassTime, intersect
from trainbpf.analyzers.vocab import STATES
from trainbpf.reports.html_job import Lane, rank_section, trainer_lanes
from trainbpf.reports.python_frames import python_line

if TYPE_CHECKING:
    from trainbpf.reports.document import Report

STATE_COLORS = {
    "running": "#2e9e44", "runnable": "#f29d38", "futex": "#8e6bd1", "sleep": "#8fc1e3",
    "page_faults": "#d64545", "mmap_lock": "#a0522d", "memory_reclaim": "#c2389a",
    "dirty_throttling": "#e8702a", "block_io": "#2f6db5", "uninterruptible": "#7a7a7a",
    "short_wait": "#c8c8c8", "other": "#4d4d4d",
}
CATEGORY_COLORS = {c.name: c.colour for c in REGISTRY}
# The timeline's row of host-bound time, in the colour of the trainer's own computation.
HOST_ROW = "host-bound"
HOST_COLOUR = CATEGORY_COLORS["host_compute"]
WIDTH = 1200
LEFT = 150
RIGHT = 40
BINS = 400
MAX_THREAD_BARS = 60
MAX_CUDA_TRACKS = 16
# A rank's lane: its trainer's states over a strip of its starved time by cause.
RANK_STATE_H, RANK_STRIP_H, RANK_GAP = 26, 8, 6
CUDA_COLORS = {"cuda-wait": "#6a3d9a", "cuda-gap": "#ff7f0e", "cuda-launch": "#2ca02c"}

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #1d1d1f; background: #fff; }
h1 { font-size: 22px; margin: 0 0 6px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.meta { color: #444; margin: 2px 0; }
.warning { background: #fff3cd; border: 1px solid #e0b000; padding: 8px 12px; margin: 10px 0; font-weight: 600; }
.note { background: #eef4fb; border: 1px solid #9bbbe0; padding: 8px 12px; margin: 10px 0; }
.finding { border: 1px solid #ddd; border-left: 6px solid #999; padding: 10px 14px; margin: 12px 0; border-radius: 4px; }
.finding.critical { border-left-color: #d62728; } .finding.warning { border-left-color: #e8a400; } .finding.info { border-left-color: #7aa6d6; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; color: #fff; margin-left: 8px; }
.badge.critical { background: #d62728; } .badge.warning { background: #e8a400; } .badge.info { background: #7aa6d6; }
.share { display: inline-block; width: 160px; height: 10px; background: #eee; vertical-align: middle; margin-left: 10px; }
.share > span { display: block; height: 10px; }
table { border-collapse: collapse; margin: 6px 0; } td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
table.num td.n, table.num th.n { text-align: right; }
code, pre { font: 12px/1.35 ui-monospace, Menlo, Consolas, monospace; } pre { white-space: pre-wrap; margin: 0; }
.legend span { display: inline-block; margin-right: 14px; } .legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: -1px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


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


def _timeline(analysis: Analysis, report: dict[str, Any]) -> str:
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
        for s, e in zip(_x(analysis.idle["start_ns"], analysis, WIDTH), _x(analysis.idle["end_ns"], analysis, WIDTH)):
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
            out.append(f'<polyline points="{pts}" fill="none" stroke="#111" stroke-width="1.3"><title>{_e(name)}</title></polyline>')
        out.append(f'<text x="8" y="{top + 30}" fill="#666">line: utilisation</text>')
        out.append(f'<text x="8" y="{top + 44}" fill="#666">colour: idle time</text>')
        out.append(f'<text x="8" y="{top + 58}" fill="#666">explained, by cause</text>')
        out.append(f'<text x="8" y="{top + 72}" fill="#666">grey: below {analysis.gpu_idle_threshold:g}%</text>')
    else:
        out.append(f'<text x="{x0 + 12}" y="{top + gpu_h / 2:.0f}">No GPU samples: starved time is the trainer\'s non-running time over the whole window.</text>')
    # Trainer state mix: the trainer's, or each rank's.
    y = top + gpu_h + gap
    for lane in lanes:
        out += _trainer_lane(analysis, lane, edges, y, state_h)
        y += state_h + RANK_GAP
    # Finding marks.
    # Finding marks.
    y += gap - RANK_GAP
    for i, cat in enumerate(cats):
        yy = y + i * mark_h
        out.append(f'<text x="8" y="{yy + 10}">{_e(cat)}</text>')
        per_bin = per_bin_all.get(cat, np.zeros(len(edges) - 1))
        colour = CATEGORY_COLORS.get(cat, HOST_COLOUR)
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
    for cat in (c for c in CATEGORY_COLORS if c in per_bin):
        h = np.minimum(per_bin[cat] / np.maximum(width_ns, 1.0), 1.0) * height
        for b in np.flatnonzero(h > min_h):
            out.append(f'<rect{before} x="{xs[b]:.1f}" y="{y + acc[b]:.1f}" width="{bw[b] + 0.3:.1f}" height="{h[b]:.1f}" '
                       f'fill="{CATEGORY_COLORS[cat]}"{after}/>')
        acc += h
    return out


def _trainer_lane(analysis: Analysis, lane: Lane, edges: np.ndarray, y: float, height: int) -> list[str]:
    """A trainer's state mix per column; a rank's over a strip of its own starved time,
    each cause's share of the column stacked in its colour."""
    xs = _x(edges, analysis, WIDTH)
    bw = np.diff(xs)
    state_h = height if lane.rank is None else RANK_STATE_H
    out = [f'<text x="8" y="{y + 14}">{_e(lane.label)}</text>']
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


def _cuda_chart(analysis: Analysis, report: dict[str, Any]) -> str:
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
        out.append(f'<g class="cuda-track" data-tid="{t["tid"]}"><text x="4" y="{y + 12}">{_e((t["comm"] or "?")[:16])} {t["tid"]}</text>')
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


def _cuda_section(analysis: Analysis, report: dict[str, Any]) -> list[str]:
    """The CUDA heading, summary, per-thread tracks and table; nothing without CUDA rows."""
    cuda = report["cuda"]
    if cuda is None:
        return []
    st = cuda["steps"]
    parts = ["<h2>CUDA</h2>",
             f'<p class="meta"><b>Trainer:</b> {cuda["gpu_bound_s"]:.2f} s GPU-bound (inside CUDA waits), '
             f'{cuda["launch_gap_s"]:.2f} s in launch gaps (from a GPU wait\'s end to the next launch)</p>']
    if st["count"]:
        parts.append(f'<p class="meta"><b>Steps:</b> {st["count"]}, {st["per_s"]:.1f}/s; step time p50 '
                     f'{st["p50_ms"]:.1f} ms, p99 {st["p99_ms"]:.1f} ms; host-bound {100 * st["host_bound_share"]:.1f}% '
                     "of step time</p>")
    if cuda["threads"]:
        parts += [_cuda_chart(analysis, report),
                  _legend({"GPU wait": CUDA_COLORS["cuda-wait"], "launch gap": CUDA_COLORS["cuda-gap"],
                           "launches": CUDA_COLORS["cuda-launch"]}, ("GPU wait", "launch gap", "launches"))]
        rows = "".join(f'<tr><td>{t["tid"]}</td><td>{_e(t["comm"] or "?")}</td><td class="n">{t["launches"]}</td>'
                       f'<td class="n">{t["waits"]}</td><td class="n">{t["wait_s"]:.3f}</td>'
                       f'<td class="n">{t["launch_gap_s"]:.3f}</td></tr>' for t in cuda["threads"])
        parts.append('<table class="num"><tr><th>tid</th><th>comm</th><th class="n">launches</th><th class="n">GPU waits</th>'
                     f'<th class="n">wait s</th><th class="n">launch gap s</th></tr>{rows}</table>')
    return parts


def _legend(colors: dict[str, str], names: Iterable[str]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{colors[n]}"></i>{_e(n)}</span>' for n in names
    ) + "</div>"


def _thread_bars(analysis: Analysis, report: dict[str, Any]) -> str:
    threads = report["threads"][:MAX_THREAD_BARS]
    row_h, bar_w = 18, WIDTH - LEFT - 90
    height = row_h * len(threads) + 10
    observed = observed_ns(analysis)
    longest = max([observed.get(t["tid"], 0) for t in threads] + [1])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="per-thread states" shape-rendering="crispEdges">']
    for i, t in enumerate(threads):
        y = 4 + i * row_h
        out.append(f'<text x="4" y="{y + 12}">{_e((t["comm"] or "?")[:16])} {t["tid"]}</text>')
        x = float(LEFT)
        for state in STATES:
            sec = t["seconds"].get(state, 0.0)
            if sec <= 0:
                continue
            w = sec * NS_PER_S / longest * bar_w
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{row_h - 4}" fill="{STATE_COLORS[state]}">'
                f"<title>{_e(state)}: {sec:.3f} s</title></rect>"
            )
            x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 12}" fill="#666">{_e(t["role"])}</text>')
    out.append("</svg>")
    more = len(report["threads"]) - len(threads)
    note = f'<p class="meta">{more} more threads are listed in the table below.</p>' if more > 0 else ""
    return "\n".join(out) + note


def _evidence_table(evidence: dict[str, Any]) -> str:
    rows = []
    for key, value in evidence.items():
        if isinstance(value, float):
            text = f"{value:.4g}"
        elif isinstance(value, (dict, list)):
            text = json.dumps(value, indent=1) if value else "—"
        else:
            text = str(value) if value not in ("", None) else "—"
        rows.append(f"<tr><td><code>{_e(key)}</code></td><td><pre>{_e(text)}</pre></td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _findings(report: dict[str, Any]) -> str:
    if not report["findings"]:
        return '<p>No findings: the trainer was never starved in the analysed window.</p>'
    out = []
    for i, f in enumerate(report["findings"], 1):
        sev = _e(f["severity"])
        color = CATEGORY_COLORS.get(f["category"], "#999")
        chain = " ← ".join(f"{_e(c['role'])} {c['tid']} [{_e(c['state'])}]" for c in f["chain"])
        threads = ", ".join(f"{_e(t['comm'] or '?')} ({t['tid']}, {_e(t['role'])})" for t in f["threads"])
        python = python_line(f)
        out.append(
            f'<div class="finding {sev}"><div><b>{i}. {_e(f["category"])}</b><span class="badge {sev}">{sev}</span>'
            f' &nbsp; {100 * f["share"]:.1f}% of starved time, {f["seconds"]:.2f} s'
            f'<span class="share"><span style="width:{100 * f["share"]:.1f}%;background:{color}"></span></span></div>'
            f'<p>{_e(f["summary"])}</p>'
            + (f"<p><b>Threads:</b> {threads}</p>" if threads else "")
            + (f"<p><b>Chain:</b> {chain}</p>" if chain else "")
            + (f'<p class="python"><b>Python:</b> {_e(python)}</p>' if python else "")
            + (f'<p><b>Launch gaps:</b> {f["launch_gap_s"]:.2f} s of it fell in launch gaps</p>'
               if f["launch_gap_s"] is not None else "")
            + f'<p><b>What to do:</b> {_e(f["recommendation"])}</p>'
            + "<details open><summary>Evidence</summary>" + _evidence_table(f["evidence"]) + "</details></div>"
        )
    return "\n".join(out)


def _thread_table(report: dict[str, Any]) -> str:
    used = [s for s in STATES if any(s in t["seconds"] for t in report["threads"])]
    head = "".join(f'<th class="n">{_e(s)}</th>' for s in used)
    rows = []
    for t in report["threads"]:
        cells = "".join(f'<td class="n">{t["seconds"].get(s, 0.0):.3f}</td>' for s in used)
        rows.append(f"<tr><td>{t['tid']}</td><td>{_e(t['comm'] or '?')}</td><td>{_e(t['role'])}</td>{cells}</tr>")
    return f'<table class="num"><tr><th>tid</th><th>comm</th><th>role</th>{head}</tr>{"".join(rows)}</table>'


def render_html(rendered: Report) -> str:
    """The report as one HTML file that opens offline."""
    analysis, report = rendered.analysis, rendered.doc
    tr, gpu = report["trace"], report["gpu"]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trainbpf report: {_e(tr['path'])}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>trainbpf report</h1>",
        f'<p class="meta"><b>Trace:</b> <code>{_e(tr["path"])}</code> · {tr["duration_s"]:.2f} s analysed · pid {_e(tr["pid"])}</p>',
    ]
    if gpu["samples"]:
        parts.append(
            f'<p class="meta"><b>GPU:</b> {_e(gpu["source"])}, {gpu["samples"]} samples, idle '
            f'{100 * (gpu["idle_fraction"] or 0):.1f}% of the time (1 - mean utilisation)</p>'
        )
    else:
        parts.append(
            '<div class="note">No GPU samples in this trace: starved time is the trainer\'s non-running '
            "time (off-CPU, runnable, or stalled in the kernel's fault/reclaim paths).</div>"
        )
    parts.append(f'<p class="meta"><b>Starved time:</b> {report["starved_s"]:.2f} s; <b>host-bound</b> (the trainer '
                 f'busy on the CPU itself): {report["host_bound_s"]:.2f} s</p>')
    if tr["lost_events"]:
        per = ", ".join(f"{_e(k)}: {v}" for k, v in sorted(analysis.lost.items()))
        parts.append(
            f'<div class="warning">WARNING: {tr["lost_events"]} events were lost ({per}); the numbers '
            "below undercount what happened.</div>"
        )
    if not report["threads"]:
        parts.append(
            '<div class="note">This trace holds no thread activity: no events were recorded, so there '
            "is nothing to attribute.</div></body></html>"
        )
        return "\n".join(parts) + "\n"
    parts += [
        "<h2>GPU-starvation timeline</h2>",
        _timeline(analysis, report),
        _legend(STATE_COLORS, STATES),
        *rank_section(report),
        *_cuda_section(analysis, report),
        "<h2>Findings</h2>",
        _findings(report),
        "<h2>Threads</h2>",
        _thread_bars(analysis, report),
        _thread_table(report),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"

