"""The report layer: the JSON contract (DESIGN §5), the terminal text, and `run_analyze`,
which `trainbpf analyze` calls."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from trainbpf.analyzers import Analysis, analyze, observed_ns
from trainbpf.analyzers.categories import STATES
from trainbpf.analyzers.intervals import NS_PER_S, parse_window
from trainbpf.analyzers.states import state_seconds
from trainbpf.errors import UsageError
from trainbpf.safefile import check_output, invoker, write_new
from trainbpf.tracefile import read_trace

REPORT_SCHEMA = "trainbpf.report/1"
FORMATS = ("text", "json", "html")
# Stack walks lost to stack-map collisions worth a note in the text report (a share).
STACK_LOSS_NOTE_SHARE = 0.01
_ROLE_ORDER = {"trainer": 0, "dataloader": 1, "pin_memory": 2, "checkpoint": 3, "autograd": 4, "other": 5}


def plain(obj: Any) -> Any:
    """JSON-safe plain Python values: numpy scalars unwrapped, floats to 6 decimals,
    NaN/inf as null."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [plain(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return round(value, 6) if math.isfinite(value) else None
    if obj is None or isinstance(obj, str):
        return obj
    return str(obj)


def _share(value: float) -> float:
    """Shares rounded down, so rounding never lifts their sum above 1."""
    return math.floor(float(value) * 1e6) / 1e6


def _seconds(value: float) -> float:
    return round(float(value), 6)


def build_report(analysis: Analysis) -> dict[str, Any]:
    """The `--format json` document, exactly DESIGN §5's contract."""
    findings = []
    for f in analysis.findings.itertuples(index=False):
        findings.append({
            "category": str(f.category),
            "share": _share(f.share),
            "seconds": _seconds(f.seconds),
            "severity": str(f.severity),
            "threads": [{"tid": int(t["tid"]), "comm": str(t["comm"]), "role": str(t["role"])} for t in f.threads],
            "chain": [{"tid": int(c["tid"]), "role": str(c["role"]), "state": str(c["state"])} for c in f.chain],
            "summary": str(f.summary),
            "evidence": plain(f.evidence),
            "recommendation": str(f.recommendation),
        })
    findings.sort(key=lambda f: (-f["share"], -f["seconds"]))
    seconds = state_seconds(analysis.totals)
    threads = analysis.threads.assign(order=analysis.threads["role"].astype(str).map(_ROLE_ORDER))
    rows = []
    for th in threads.sort_values(["order", "tid"], kind="stable").itertuples(index=False):
        rows.append({
            "tid": int(th.tid), "comm": str(th.comm), "role": str(th.role),
            "seconds": {k: _seconds(v) for k, v in seconds.get(int(th.tid), {}).items()},
        })
    pid = analysis.meta.get("target_pid")
    return {
        "schema": REPORT_SCHEMA,
        "trace": {
            "path": analysis.path,
            "duration_s": _seconds(analysis.window.seconds),
            "pid": int(pid) if pid is not None else None,
            "lost_events": int(sum(analysis.lost.values())),
        },
        "gpu": {
            "source": analysis.gpu_source,
            "samples": analysis.gpu_samples,
            "idle_fraction": None if analysis.idle_fraction is None else _seconds(analysis.idle_fraction),
        },
        "starved_s": _seconds(analysis.starved_ns / NS_PER_S),
        "findings": findings,
        "threads": rows,
    }


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _thread_label(t: dict[str, Any]) -> str:
    return f"{t.get('comm') or '?'} ({t['tid']}, {t['role']})"


def render_text(report: dict[str, Any], analysis: Analysis | None = None) -> str:
    """The terminal report.  `analysis` adds what the JSON does not carry (window,
    threshold, lost events per probe)."""
    lines: list[str] = []
    tr, gpu = report["trace"], report["gpu"]
    lines.append(f"trainbpf report: {tr['path']}")
    where = ""
    if analysis is not None and analysis.window != analysis.span:
        lo = (analysis.window.start_ns - analysis.span.start_ns) / NS_PER_S
        hi = (analysis.window.end_ns - analysis.span.start_ns) / NS_PER_S
        where = f" (window {lo:g}-{hi:g} s of {analysis.span.seconds:.2f} s)"
    trainer = next((t for t in report["threads"] if t["role"] == "trainer"), None)
    who = f"trainer {_thread_label(trainer)}" if trainer else "no trainer thread found"
    lines.append(f"  duration {tr['duration_s']:.2f} s{where}; pid {tr['pid'] if tr['pid'] is not None else '?'}; {who}")
    if tr["lost_events"]:
        per = ""
        if analysis is not None and analysis.lost:
            per = " (" + ", ".join(f"{k}: {v}" for k, v in sorted(analysis.lost.items())) + ")"
        lines.append(
            f"WARNING: {tr['lost_events']} events were lost{per}: ring buffers overflowed, so the "
            "numbers below undercount what happened."
        )
    stacks = (analysis.meta.get("stacks") or {}) if analysis is not None else {}
    collided, walks = int(stacks.get("collisions") or 0), int(stacks.get("walks") or 0)
    if collided and collided >= STACK_LOSS_NOTE_SHARE * walks:
        lines.append(f"NOTE: {collided} of {walks} stack walks ({100 * collided / max(walks, 1):.0f}%) found their "
                     "slot in the kernel's stack map held by another stack: those events carry no stack, so "
                     "stacks shown as evidence may miss some call paths.")
    if analysis is not None and analysis.unfinished:
        lines.append("NOTE: the recording did not finish cleanly (recovered or unfinished spool).")

    empty = not report["threads"]
    if empty:
        lines.append("")
        lines.append(
            "This trace holds no thread activity: no events were recorded, so there is nothing to "
            "attribute and no findings. Check that the target was running and the probes attached "
            "(`trainbpf doctor`), then record for longer."
        )
        return "\n".join(lines) + "\n"

    if gpu["samples"]:
        idle = gpu["idle_fraction"] or 0.0
        lines.append(f"  GPU: {gpu['source']}, {gpu['samples']} samples; idle {_pct(idle)} of the time "
                     "(1 - mean utilisation)")
        lines.append(
            f"  Starved time: {report['starved_s']:.2f} s (GPU idle time that the trainer's stalls explain: "
            "in each sample at most its idle time)"
        )
        if analysis is not None and analysis.unwoken_idle_ns >= 0.01 * max(analysis.idle_ns, 1.0):
            lines.append(
                f"  Not counted: {analysis.unwoken_idle_ns / NS_PER_S:.2f} s of idle time overlapped sleeps no "
                "thread ended (a GPU synchronisation looks so, or a timer: see docs/findings.md)"
            )
    else:
        lines.append("  GPU: no GPU samples in this trace.")
        lines.append(
            f"  Starved time: {report['starved_s']:.2f} s. Without GPU samples, starved time is the "
            "trainer's non-running time (off-CPU, runnable, or on-CPU in the kernel's fault/reclaim paths)."
        )
    lines.append("")
    findings = report["findings"]
    if not findings:
        lines.append("No findings: the trainer was never starved" + (" while the GPU idled." if gpu["samples"] else "."))
    else:
        lines.append("Findings, ranked by share of starved time:")
        for i, f in enumerate(findings, 1):
            lines.append(
                f"{i:2d}. {f['category']:<17} {_pct(f['share']):>6}  {f['seconds']:8.2f} s  {f['severity'].upper()}"
            )
            lines.append(f"    {f['summary']}")
            if f["threads"]:
                lines.append("    threads: " + ", ".join(_thread_label(t) for t in f["threads"]))
            if len(f["chain"]) > 1:
                lines.append("    chain: " + " <- ".join(f"{c['role']} {c['tid']} [{c['state']}]" for c in f["chain"]))
            lines.append(f"    do: {f['recommendation']}")
    if not any(f["severity"] == "critical" for f in findings):
        lines.append("")
        lines.append("No critical finding.")
    lines.append("")
    lines.extend(_thread_table(report, analysis))
    return "\n".join(lines) + "\n"


def _thread_table(report: dict[str, Any], analysis: Analysis | None) -> list[str]:
    used = [s for s in STATES if any(s in t["seconds"] for t in report["threads"])]
    head = ["tid", "comm", "role"] + used + ["observed"]
    observed = observed_ns(analysis) if analysis is not None else None
    rows = []
    for t in report["threads"]:
        total = sum(t["seconds"].values())
        if observed is not None:
            total = float(observed.get(t["tid"], 0)) / NS_PER_S
        rows.append([str(t["tid"]), t["comm"] or "?", t["role"]] + [f"{t['seconds'].get(s, 0.0):.2f}" for s in used] + [f"{total:.2f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return ["Threads (seconds per state):", "  " + fmt(head)] + ["  " + fmt(r) for r in rows]


def _write(output: str | os.PathLike, text: str, *, force: bool = False) -> None:
    """Write a report privately (it names threads and addresses, like the trace)."""
    write_new(output, lambda fh: fh.write(text.encode("utf-8")), owner=invoker(), force=force)


def run_analyze(
    *,
    path: str | os.PathLike,
    fmt: str = "text",
    output: str | os.PathLike | None = None,
    trainer_tid: int | None = None,
    gpu_idle_threshold: float = 10.0,
    window: tuple[float | None, float | None] | str | None = None,
    force: bool = False,
) -> str:
    """Analyse a trace and render it as `fmt` (text, json, html); write it to `output`
    when given (an existing file only with `force`); return the text.  Raises trainbpf.errors exceptions only."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    try:
        threshold = float(gpu_idle_threshold)
    except (TypeError, ValueError):
        raise UsageError(f"bad --gpu-idle-threshold {gpu_idle_threshold!r}: a percentage 0-100") from None
    if not 0.0 <= threshold <= 100.0:
        raise UsageError(f"bad --gpu-idle-threshold {gpu_idle_threshold!r}: a percentage 0-100")
    if isinstance(window, str):
        window = parse_window(window)
    if output is not None:
        check_output(output, force=force)  # before the analysis, not after it
    trace = read_trace(path)
    analysis = analyze(trace, trainer_tid=trainer_tid, gpu_idle_threshold=threshold, window=window)
    report = build_report(analysis)
    if fmt == "json":
        text = json.dumps(report, indent=2) + "\n"
    elif fmt == "html":
        from trainbpf.html_report import render_html

        text = render_html(analysis, report)
    else:
        text = render_text(report, analysis)
    if output is not None:
        _write(output, text, force=force)
    return text
