"""The options of `trainbpf analyze`, each declared once: the report formats, the GPU
idle threshold (default and bounds) and the analysed window.  The CLI parses a command
line into these types at the edge, once; the library (trainbpf.reports.render.run_analyze,
trainbpf.analyzers.analyze) takes them as they are.  Light on purpose: the CLI imports it to build
its options without loading the analyzers."""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple

from trainbpf.trace.errors import UsageError


class ReportFormat(str, enum.Enum):
    """What `analyze` renders: the terminal text, the JSON contract, or one HTML file."""

    text = "text"
    json = "json"
    html = "html"

    @classmethod
    def of(cls, value: Any) -> "ReportFormat":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(f.value for f in cls)
            raise UsageError(f"unknown format {value!r}: choose one of {choices}") from None


# GPU samples below this utilisation percent are shaded in the HTML timeline: the HTML
# renderer's knob (the analysis never sees it; starved time uses each sample's own
# utilisation).
GPU_IDLE_THRESHOLD = 10.0
GPU_IDLE_THRESHOLD_MIN = 0.0
GPU_IDLE_THRESHOLD_MAX = 100.0


def check_gpu_idle_threshold(value: Any) -> float:
    """A GPU idle threshold as a percentage within its bounds; else a UsageError."""
    try:
        threshold = float(value)
    except (TypeError, ValueError):
        threshold = math.nan
    if not GPU_IDLE_THRESHOLD_MIN <= threshold <= GPU_IDLE_THRESHOLD_MAX:
        raise UsageError(f"bad --gpu-idle-threshold {value!r}: a percentage 0-100")
    return threshold


class Window(NamedTuple):
    """The analysed part of a trace, in seconds from its start; None: from the start /
    to the end.  Checked against the trace by analyzers.intervals.resolve_window."""

    start_s: float | None = None
    end_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Window | None":
        """"START:END" in seconds from the trace start; either side may be empty."""
        if text is None or text == "":
            return None
        head, sep, tail = str(text).partition(":")
        if not sep:
            raise UsageError(f"bad window {text!r}: expected START:END in seconds, e.g. 5:20")
        try:
            start = float(head) if head.strip() else None
            end = float(tail) if tail.strip() else None
        except ValueError:
            raise UsageError(f"bad window {text!r}: START and END must be numbers of seconds") from None
        return cls(start, end)
