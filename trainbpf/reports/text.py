"""The terminal report (`trainbpf analyze`, the default format): the trace, GPU and
starved-time lines, the findings ranked, and the threads' seconds per state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainbpf.analyzers.intervals import NS_PER_S
from trainbpf.analyzers.pipeline import observed_ns
from trainbpf.analyzers.vocab import STATES
from trainbpf.reports.buffers import buffer_lines
from trainbpf.reports.job import rank_lines
from trainbpf.reports.present import (container_words, culprit_lines, memory_sentences, numa_sentences, pct, size,
                                      task_label)
from trainbpf.reports.python_frames import python_line, refused_note
from trainbpf.trace.printable import printable

if TYPE_CHECKING:
    from trainbpf.analyzers.pipeline import Analysis
from trainbpf.reports.document import Report

# Stack walks lost to stack-map collisions worth a note in the text report (a share).
STACK_LOSS_NOTE_SHARE = 0.01


def _thread_label(t: dict[str, Any]) -> str:
    return f"{t.get('comm') or '?'} ({t['tid']}, {t['role']})"


def _process_label(c: dict[str, Any]) -> str:
    """A task that preempted the finding's threads: its name, process and preemptions."""
    return f"{task_label(c)} {c['count']} time{'s' if c['count'] != 1 else ''}"


def render_text(rendered: Report) -> str:
    """The terminal report: the JSON document's content, and from the analysis what the
    JSON does not carry (window, lost events per probe, stack losses, unwoken idle time)."""
    report, analysis = rendered.doc, rendered.analysis
    lines: list[str] = []
    tr, gpu = report["trace"], report["gpu"]
    lines.append(f"trainbpf report: {tr['path']}")
    where = ""
    if analysis.window != analysis.span:
        lo = (analysis.window.start_ns - analysis.span.start_ns) / NS_PER_S
        hi = (analysis.window.end_ns - analysis.span.start_ns) / NS_PER_S
        where = f" (window {lo:g}-{hi:g} s of {analysis.span.seconds:.2f} s)"
    trainer = next((t for t in report["threads"] if t["role"] == "trainer" and t["tid"] == analysis.trainer_tid),
                   next((t for t in report["threads"] if t["role"] == "trainer"), None))
    who = f"trainer {_thread_label(trainer)}" if trainer else "no trainer thread found"
    if report["ranks"]:
        who = f"a job of {len(report['ranks'])} ranks, one trainer each"
    lines.append(f"  duration {tr['duration_s']:.2f} s{where}; pid {tr['pid'] if tr['pid'] is not None else '?'}; {who}")
    if report["container"]:
        lines.append(f"  container: {container_words(report['container'])}; cgroup {report['container']['cgroup']}")
    if tr["lost_events"]:
        per = ""
        if analysis.lost:
            per = " (" + ", ".join(f"{k}: {v}" for k, v in sorted(analysis.lost.items())) + ")"
        lines.append(
            f"WARNING: {tr['lost_events']} events were lost{per}: ring buffers overflowed, so the "
            "numbers below undercount what happened."
        )
    stacks = analysis.meta.get("stacks") or {}
    collided, walks = int(stacks.get("collisions") or 0), int(stacks.get("walks") or 0)
    if collided and collided >= STACK_LOSS_NOTE_SHARE * walks:
        lines.append(f"NOTE: {collided} of {walks} stack walks ({100 * collided / max(walks, 1):.0f}%) found their "
                     "slot in the kernel's stack map held by another stack: those events carry no stack, so "
                     "stacks shown as evidence may miss some call paths.")
    python_note = refused_note(analysis.meta)
    if python_note:
        lines.append(python_note)
    if analysis.unfinished:
        lines.append("NOTE: the recording did not finish cleanly (recovered or unfinished spool).")

    empty = not report["threads"]
    if empty:
        lines.append("")
        lines.append(
            "This trace holds no thread activity: no events were recorded, so there is nothing to "
            "attribute and no findings. Check that the target was running and the probes attached "
            "(`trainbpf doctor`), then record for longer."
        )
        return as_text(lines)

    lines.extend(starved_lines(report))
    if gpu["samples"] and analysis.unwoken_idle_ns >= 0.01 * max(analysis.idle_ns, 1.0):
        lines.append(
            f"  Not counted: {analysis.unwoken_idle_ns / NS_PER_S:.2f} s of idle time overlapped sleeps no "
            "thread ended (a GPU synchronisation looks so, or a timer: see docs/findings.md)"
        )
    if analysis.uses_cuda and not gpu["samples"]:
        lines.append(_host_line(report))
    lines.extend(rank_lines(report, analysis.meta))
    lines.extend(_cuda_lines(report, analysis))
    lines.extend(f"  {line}" for line in memory_sentences(report["memory"]) + numa_sentences(report.get("numa")))
    lines.extend(buffer_lines(report))
    lines.append("")
    lines.extend(finding_lines(report["findings"], gpu=bool(gpu["samples"])))
    lines.append("")
    lines.extend(_thread_table(report, analysis))
    return as_text(lines)


def starved_lines(report: dict[str, Any]) -> list[str]:
    """The GPU samples, starved time and (with samples) host-bound time."""
    gpu = report["gpu"]
    if gpu["samples"]:
        idle = gpu["idle_fraction"] or 0.0
        summed = ", summed over the ranks (each rank's GPU against its own trainer)" if report["ranks"] else ""
        return [f"  GPU: {gpu['source']}, {gpu['samples']} samples; idle {pct(idle)} of the time (1 - mean utilisation)",
                f"  Starved time: {report['starved_s']:.2f} s{summed} (GPU idle time that the trainer's stalls and own "
                "CPU work explain: in each sample at most its idle time)",
                _host_line(report)]
    return ["  GPU: no GPU samples in this trace.",
            f"  Starved time: {report['starved_s']:.2f} s. Without GPU samples, starved time is the "
            "trainer's non-running time (off-CPU, runnable, or on-CPU in the kernel's fault/reclaim paths)."]


def finding_lines(findings: list[dict[str, Any]], *, gpu: bool) -> list[str]:
    """The findings ranked, each with its summary, threads, chain, Python line, launch
    gaps and what to do; `gpu`: whether starved time is measured against GPU samples."""
    lines = []
    if not findings:
        lines.append("No findings: the trainer was never starved" + (" while the GPU idled." if gpu else "."))
    else:
        lines.append("Findings, ranked by share of starved time:")
        for i, f in enumerate(findings, 1):
            lines.extend(_finding_lines(i, f))
    if not any(f["severity"] == "critical" for f in findings):
        lines.append("")
        lines.append("No critical finding.")
    return lines


def _finding_lines(i: int, f: dict[str, Any]) -> list[str]:
    """Finding `i` of the report: its rank line, summary, threads, chain, the tasks that
    took the CPU, Python frames, launch gaps and recommendation."""
    lines = [f"{i:2d}. {f['category']:<17} {pct(f['share']):>6}  {f['seconds']:8.2f} s  {f['severity'].upper()}",
             f"    {f['summary']}"]
    if f["threads"]:
        lines.append("    threads: " + ", ".join(_thread_label(t) for t in f["threads"]))
    if len(f["chain"]) > 1:
        lines.append("    chain: " + " <- ".join(f"{c['role']} {c['tid']} [{c['state']}]" for c in f["chain"]))
    took = [c for c in f["culprits"] if c["kind"] == "process" and "count" in c]
    if took:
        lines.append("    took the CPU: " + ", ".join(_process_label(c) for c in took))
    lines += [f"    {line}" for line in culprit_lines(f["culprits"])]
    python = python_line(f)
    if python:
        lines.append(f"    python: {python}")
    if f["launch_gap_s"] is not None:
        lines.append(f"    launch gaps: {f['launch_gap_s']:.2f} s of it fell in launch gaps (the GPU had "
                     "finished its work and the trainer had not yet launched more)")
    lines.append(f"    do: {f['recommendation']}")
    return lines


def as_text(lines: list[str]) -> str:
    """The report's lines as its text: names from the trace (threads, the path, Python
    functions) quoted in them cannot drive the terminal or add lines."""
    return "".join(printable(line) + "\n" for line in lines)


def _thread_table(report: dict[str, Any], analysis: Analysis) -> list[str]:
    used = [s for s in STATES if any(s in t["seconds"] for t in report["threads"])]
    net = any("network" in t for t in report["threads"])  # socket bytes in and out
    head = ["tid", "comm", "role"] + used + ["observed"] + (["net in", "net out"] if net else [])
    observed = observed_ns(analysis)
    rows = []
    for t in report["threads"]:
        total = float(observed.get(t["tid"], 0)) / NS_PER_S
        moved = t.get("network") or {"recv_bytes": 0, "send_bytes": 0}
        rows.append([str(t["tid"]), printable(t["comm"] or "?"), t["role"]] + [f"{t['seconds'].get(s, 0.0):.2f}" for s in used]
                    + [f"{total:.2f}"] + ([size(moved["recv_bytes"]), size(moved["send_bytes"])] if net else []))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return ["Threads (seconds per state):", "  " + fmt(head)] + ["  " + fmt(r) for r in rows]


def _cuda_lines(report: dict[str, Any], analysis: Any) -> list[str]:
    """What the CUDA probe's rows add (the JSON `cuda` section): the trainer's GPU-bound
    time, launch gaps and step rhythm, and a line per thread that made CUDA calls."""
    cuda = report["cuda"]
    if cuda is None:
        return []
    lines = []
    if analysis.uses_cuda:
        lines.append(f"  GPU-bound: {cuda['gpu_bound_s']:.2f} s of the trainer's stalls were inside CUDA "
                     "synchronisations or blocking copies (waiting for a busy GPU: not starvation); launch gaps "
                     f"{cuda['launch_gap_s']:.2f} s (from a GPU wait's end to the next launch)")
    st = cuda["steps"]
    if st["count"]:
        lines.append(f"  Steps (from CUDA waits and launches): {st['count']}, {st['per_s']:.1f}/s; step time "
                     f"p50 {st['p50_ms']:.1f} ms, p99 {st['p99_ms']:.1f} ms; host-bound "
                     f"{pct(st['host_bound_share'])} of step time (launch gaps)")
    for t in cuda["threads"]:
        lines.append(f"  CUDA {t['comm'] or '?'} ({t['tid']}): {t['launches']} launches, {t['waits']} GPU waits "
                     f"({t['wait_s']:.2f} s), launch gaps {t['launch_gap_s']:.2f} s")
    return lines


def _host_line(report: dict[str, Any]) -> str:
    """The part of starved time the trainer's own CPU work explains."""
    return (f"  Host-bound: {report['host_bound_s']:.2f} s of it the trainer was busy on the CPU itself, outside GPU "
            "synchronisations (data loading in its own thread, optimizer steps, Python between launches)")
