"""A self-contained HTML report: inline CSS and SVG, no scripts, no network.  The page
shows the report's numbers for people (trainbpf/reports/present.py: units, Python frames as
stacks); its charts are drawn in trainbpf/reports/html_timeline.py, a job's ranks in
trainbpf/reports/html_job.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from trainbpf.analyzers.intervals import NS_PER_S
from trainbpf.analyzers.options import GPU_IDLE_THRESHOLD
from trainbpf.analyzers.pipeline import Analysis, observed_ns
from trainbpf.analyzers.vocab import STATES
from trainbpf.reports.buffers import buffer_html
from trainbpf.reports.html_job import rank_section
from trainbpf.reports.html_timeline import (
    CUDA_COLORS,
    LEFT,
    STATE_COLORS,
    WIDTH,
    cause_colour,
    cuda_chart,
    esc,
    timeline,
)
from trainbpf.reports.present import (container_words, culprit_lines, evidence_lines, memory_sentences,
                                      numa_sentences, pct)
from trainbpf.reports.python_frames import python_line

if TYPE_CHECKING:
    from trainbpf.reports.document import Report

MAX_THREAD_BARS = 60

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
                     f'{st["p50_ms"]:.1f} ms, p99 {st["p99_ms"]:.1f} ms; host-bound {pct(st["host_bound_share"])} '
                     "of step time</p>")
    if cuda["threads"]:
        parts += [cuda_chart(analysis, report),
                  _legend({"GPU wait": CUDA_COLORS["cuda-wait"], "launch gap": CUDA_COLORS["cuda-gap"],
                           "launches": CUDA_COLORS["cuda-launch"]}, ("GPU wait", "launch gap", "launches"))]
        rows = "".join(f'<tr><td>{t["tid"]}</td><td>{esc(t["comm"] or "?")}</td><td class="n">{t["launches"]}</td>'
                       f'<td class="n">{t["waits"]}</td><td class="n">{t["wait_s"]:.3f}</td>'
                       f'<td class="n">{t["launch_gap_s"]:.3f}</td></tr>' for t in cuda["threads"])
        parts.append('<table class="num"><tr><th>tid</th><th>comm</th><th class="n">launches</th><th class="n">GPU waits</th>'
                     f'<th class="n">wait s</th><th class="n">launch gap s</th></tr>{rows}</table>')
    return parts


def _memory_section(report: dict[str, Any]) -> list[str]:
    """The THP mode, each process's faults per MiB newly mapped and the copies' source
    nodes; nothing when unknown."""
    sentences = memory_sentences(report["memory"]) + numa_sentences(report.get("numa"))
    return ["<h2>Memory</h2>", *(f'<p class="meta">{esc(s)}</p>' for s in sentences)] if sentences else []


def _legend(colors: dict[str, str], names: Iterable[str]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{colors[n]}"></i>{esc(n)}</span>' for n in names
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
        out.append(f'<text x="4" y="{y + 12}">{esc((t["comm"] or "?")[:16])} {t["tid"]}</text>')
        x = float(LEFT)
        for state in STATES:
            sec = t["seconds"].get(state, 0.0)
            if sec <= 0:
                continue
            w = sec * NS_PER_S / longest * bar_w
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{row_h - 4}" fill="{STATE_COLORS[state]}">'
                f"<title>{esc(state)}: {sec:.3f} s</title></rect>"
            )
            x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 12}" fill="#666">{esc(t["role"])}</text>')
    out.append("</svg>")
    more = len(report["threads"]) - len(threads)
    note = f'<p class="meta">{more} more threads are listed in the table below.</p>' if more > 0 else ""
    return "\n".join(out) + note


def _evidence_table(evidence: dict[str, Any]) -> str:
    """A finding's evidence, a row per key: numbers in their units, stacks a frame a line."""
    rows = [f"<tr><td><code>{esc(key)}</code></td><td><pre>{esc(chr(10).join(evidence_lines(key, value)))}</pre></td></tr>"
            for key, value in evidence.items()]
    return '<table class="evidence">' + "".join(rows) + "</table>"


def _findings(report: dict[str, Any]) -> str:
    if not report["findings"]:
        return '<p>No findings: the trainer was never starved in the analysed window.</p>'
    out = []
    for i, f in enumerate(report["findings"], 1):
        sev = esc(f["severity"])
        color = cause_colour(f["category"])
        chain = " ← ".join(f"{esc(c['role'])} {c['tid']} [{esc(c['state'])}]" for c in f["chain"])
        threads = ", ".join(f"{esc(t['comm'] or '?')} ({t['tid']}, {esc(t['role'])})" for t in f["threads"])
        python = python_line(f)
        culprits = culprit_lines(f["culprits"])
        out.append(
            f'<div class="finding {sev}"><div><b>{i}. {esc(f["category"])}</b><span class="badge {sev}">{sev}</span>'
            f' &nbsp; {pct(f["share"])} of starved time, {f["seconds"]:.2f} s'
            f'<span class="share"><span style="width:{100 * f["share"]:.1f}%;background:{color}"></span></span></div>'
            f'<p>{esc(f["summary"])}</p>'
            + (f"<p><b>Threads:</b> {threads}</p>" if threads else "")
            + (f"<p><b>Chain:</b> {chain}</p>" if chain else "")
            + (f"<p><b>Culprits:</b><br>{'<br>'.join(esc(line) for line in culprits)}</p>" if culprits else "")
            + (f'<p class="python"><b>Python:</b> {esc(python)}</p>' if python else "")
            + (f'<p><b>Launch gaps:</b> {f["launch_gap_s"]:.2f} s of it fell in launch gaps</p>'
               if f["launch_gap_s"] is not None else "")
            + f'<p><b>What to do:</b> {esc(f["recommendation"])}</p>'
            + "<details open><summary>Evidence</summary>" + _evidence_table(f["evidence"]) + "</details></div>"
        )
    return "\n".join(out)


def _thread_table(report: dict[str, Any]) -> str:
    used = [s for s in STATES if any(s in t["seconds"] for t in report["threads"])]
    head = "".join(f'<th class="n">{esc(s)}</th>' for s in used)
    rows = []
    for t in report["threads"]:
        cells = "".join(f'<td class="n">{t["seconds"].get(s, 0.0):.3f}</td>' for s in used)
        rows.append(f"<tr><td>{t['tid']}</td><td>{esc(t['comm'] or '?')}</td><td>{esc(t['role'])}</td>{cells}</tr>")
    return f'<table class="num"><tr><th>tid</th><th>comm</th><th>role</th>{head}</tr>{"".join(rows)}</table>'


def render_html(rendered: Report, *, gpu_idle_threshold: float = GPU_IDLE_THRESHOLD) -> str:
    """The report as one HTML file that opens offline; the timeline shades GPU samples
    below `gpu_idle_threshold` percent (analyze_options: the knob is this renderer's)."""
    analysis, report = rendered.analysis, rendered.doc
    tr, gpu = report["trace"], report["gpu"]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trainbpf report: {esc(tr['path'])}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>trainbpf report</h1>",
        f'<p class="meta"><b>Trace:</b> <code>{esc(tr["path"])}</code> · {tr["duration_s"]:.2f} s analysed · pid {esc(tr["pid"])}</p>',
    ]
    if report["container"]:
        parts.append(f'<p class="meta"><b>Container:</b> {esc(container_words(report["container"]))} · cgroup '
                     f'<code>{esc(report["container"]["cgroup"])}</code></p>')
    if gpu["samples"]:
        parts.append(
            f'<p class="meta"><b>GPU:</b> {esc(gpu["source"])}, {gpu["samples"]} samples, idle '
            f'{pct(gpu["idle_fraction"] or 0)} of the time (1 - mean utilisation)</p>'
        )
    else:
        parts.append(
            '<div class="note">No GPU samples in this trace: starved time is the trainer\'s non-running '
            "time (off-CPU, runnable, or stalled in the kernel's fault/reclaim paths).</div>"
        )
    parts.append(f'<p class="meta"><b>Starved time:</b> {report["starved_s"]:.2f} s; <b>host-bound</b> (the trainer '
                 f'busy on the CPU itself): {report["host_bound_s"]:.2f} s</p>')
    if tr["lost_events"]:
        per = ", ".join(f"{esc(k)}: {v}" for k, v in sorted(analysis.lost.items()))
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
        timeline(analysis, report, gpu_idle_threshold=gpu_idle_threshold),
        _legend(STATE_COLORS, STATES),
        *rank_section(report),
        *_cuda_section(analysis, report),
        *_memory_section(report),
        "<h2>Findings</h2>",
        _findings(report),
        "<h2>Threads</h2>",
        _thread_bars(analysis, report),
        _thread_table(report),
        *buffer_html(report),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"

