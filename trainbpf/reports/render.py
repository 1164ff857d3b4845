"""`trainbpf analyze` of one trace: analyse it, render it as the chosen format (the
terminal text, the JSON contract, one HTML file) and write it.  The one module that
knows every renderer; the renderers know the report layer (trainbpf/reports/document.py) only."""

from __future__ import annotations

import functools
import os
from typing import Callable

from trainbpf.analyzers.options import (
    GPU_IDLE_THRESHOLD,
    ReportFormat,
    Window,
    check_gpu_idle_threshold,
)
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, render_json
from trainbpf.reports.html import render_html
from trainbpf.reports.network import resolve_peers
from trainbpf.reports.text import render_text
from trainbpf.trace.memory import read_for_analysis
from trainbpf.trace.safefile import OutputFile, check_output, write_new


def renderer(fmt: ReportFormat, *, gpu_idle_threshold: float = GPU_IDLE_THRESHOLD) -> Callable[[Report], str]:
    """The function that renders a Report as `fmt`; the GPU idle threshold shades the
    HTML timeline and is the HTML renderer's alone."""
    if fmt == ReportFormat.html:
        return functools.partial(render_html, gpu_idle_threshold=gpu_idle_threshold)
    return render_text if fmt == ReportFormat.text else render_json


def _write(output: str | os.PathLike | OutputFile, text: str, *, force: bool = False) -> None:
    """Write a report privately (it names threads and addresses, like the trace)."""
    write_new(output, lambda fh: fh.write(text.encode("utf-8")), force=force)


def run_analyze(
    *,
    path: str | os.PathLike,
    fmt: ReportFormat | str = ReportFormat.text,
    output: str | os.PathLike | None = None,
    trainer_tid: int | None = None,
    gpu_idle_threshold: float = GPU_IDLE_THRESHOLD,
    window: Window | None = None,
    force: bool = False,
    memory_check: bool = True,
    resolve: bool = False,
) -> str:
    """Analyse a trace and render it as `fmt` (text, json, html); write it to `output`
    when given (an existing file only with `force`); return the text.  A trace too large
    for the memory available is refused unless `memory_check` is off.  `window` comes
    parsed (Window.parse at the edge); `gpu_idle_threshold` goes to the HTML renderer
    only; `resolve` looks up the network peers' host names (never by default).  Raises
    trainbpf.trace.errors exceptions only."""
    render_as = renderer(ReportFormat.of(fmt), gpu_idle_threshold=check_gpu_idle_threshold(gpu_idle_threshold))

    def render() -> str:
        trace = read_for_analysis(path, memory_check=memory_check)
        report = Report.of(analyze(trace, trainer_tid=trainer_tid, window=window))
        if resolve:
            resolve_peers(report.doc)
        return render_as(report)

    return write_report(output, render, force=force)


def write_report(output: str | os.PathLike | None, render: Callable[[], str], *, force: bool = False) -> str:
    """The text `render()` makes, written to `output` when given (an existing file only
    with `force`); the output is checked before the work, not after it, and written
    into the folder checked then."""
    out = check_output(output, force=force) if output is not None else None
    try:
        text = render()
        if out is not None:
            _write(out, text)
    finally:
        if out is not None:
            out.close()
    return text
