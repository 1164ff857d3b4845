"""The report of several traces of one job (analyzers/job_traces.py): the JSON contract
with the keys of one trace's report (docs/findings.md, "Several nodes") and the text
report, from the same parts as one trace's (document.py, text.py, job.py here).
`run_analyze_traces` is what `trainbpf analyze NODE0 NODE1 ...` calls."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

from trainbpf.analyzers.intervals import NS_PER_S
from trainbpf.analyzers.job_traces import JobTraces, analyze_traces
from trainbpf.analyzers.options import ReportFormat
from trainbpf.reports.document import REPORT_SCHEMA, findings_section
from trainbpf.reports.job import rank_lines, ranks_section, straggler_section
from trainbpf.reports.render import write_report
from trainbpf.reports.text import as_text, finding_lines, starved_lines
from trainbpf.trace.errors import UsageError


def build_traces_report(found: JobTraces) -> dict[str, Any]:
    """The `--format json` document of several traces: one trace's keys, with `trace.path`
    the list of paths, `threads` empty (each trace's threads are in its own report),
    `cuda` null, and `traces`: per trace its path, host, launcher pid, ranks and clock."""
    job = found.job
    return {
        "schema": REPORT_SCHEMA,
        "trace": {"path": found.traces["path"].tolist(), "duration_s": round(found.window_ns / NS_PER_S, 6),
                  "pid": None, "lost_events": int(found.lost_events)},
        "gpu": {"source": found.gpu["source"], "samples": int(found.gpu["samples"]),
                "idle_fraction": None if found.gpu["idle_fraction"] is None else round(found.gpu["idle_fraction"], 6)},
        "starved_s": round(float(job.starved["ns"].sum()) / NS_PER_S, 6),
        "host_bound_s": round(found.host_bound_ns / NS_PER_S, 6),
        "ranks": ranks_section(job),
        "straggler": straggler_section(job),
        "findings": findings_section(job.findings, pids={}, trainer_tid=None,
                                     trainers=dict(zip(job.ranks["rank"].tolist(), job.ranks["trainer_tid"].tolist()))),
        "threads": [],
        "cuda": None,
        "traces": [{"path": t.path, "host": t.host or None, "pid": None if t.pid is None else int(t.pid),
                    "ranks": [int(r) for r in t.ranks], "residual_offset_ms": round(t.residual_ns / 1e6, 3),
                    "aligned_by": t.aligned_by} for t in found.traces.itertuples(index=False)],
        "container": None,  # each rank's is in `ranks`
        "memory": None,  # each trace's own report has it
    }


def render_traces_text(found: JobTraces) -> str:
    """The terminal report of several traces: the traces and their clocks, the job's
    starved time, the per-rank table and straggler line, the findings."""
    report = build_traces_report(found)
    lines = [f"trainbpf report: {len(report['traces'])} traces of one job"]
    for t in report["traces"]:
        clock = "its clock the reference" if t["aligned_by"] == "reference" else \
            f"clock {t['residual_offset_ms']:+.2f} ms from its wall-clock offset, aligned by {t['aligned_by']}"
        lines.append(f"  {t['host'] or '?'}: {t['path']} (ranks {_ranges(t['ranks'])}; {clock})")
    lines += [f"WARNING: {note}" for note in found.notes]
    hosts = len(set(found.traces["host"]))
    lines.append(f"  duration {report['trace']['duration_s']:.2f} s (the traces' windows together); a job of "
                 f"{len(report['ranks'])} ranks on {hosts} node{'s' if hosts > 1 else ''}, one trainer each")
    if report["trace"]["lost_events"]:
        lines.append(f"WARNING: {report['trace']['lost_events']} events were lost: ring buffers overflowed, so the "
                     "numbers below undercount what happened.")
    lines += starved_lines(report) + rank_lines(report, {}) + [""]
    lines += finding_lines(report["findings"], gpu=bool(report["gpu"]["samples"]))
    return as_text(lines)


def _ranges(ranks: list[int]) -> str:
    """Rank numbers as "0-3, 8"."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def run_analyze_traces(
    *,
    paths: Sequence[str | os.PathLike],
    fmt: ReportFormat | str = ReportFormat.text,
    output: str | os.PathLike | None = None,
    force: bool = False,
    memory_check: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[str, list[str]]:
    """Analyse several traces of one job as one and render the job as `fmt` (text or
    json); write it to `output` when given.  Returns the text and the warnings on the
    traces' clocks (one line each).  Raises trainbpf.trace.errors exceptions only."""
    fmt = ReportFormat.of(fmt)
    if fmt == ReportFormat.html:
        raise UsageError("--format html takes one trace; analyse several traces as text or json")
    notes: list[str] = []

    def render() -> str:
        found = analyze_traces(paths, memory_check=memory_check, progress=progress)
        notes.extend(found.notes)
        if fmt == ReportFormat.json:
            return json.dumps(build_traces_report(found), indent=2) + "\n"
        return render_traces_text(found)

    return write_report(output, render, force=force), notes
