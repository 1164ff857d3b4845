"""The renderers present the report's numbers for people (trainbpf/reports/present.py): the HTML
evidence in units (GB, MB, ms, %) and Python frames drawn as stacks, not JSON dumps; the
JSON keeps the raw numbers.  The analysis returns numbers only: the GPU idle threshold
and the stretches it shades are the HTML renderer's (that the report document imports no
renderer: tests/test_layers.py)."""

from __future__ import annotations

import dataclasses
import html
import inspect
import re
from pathlib import Path

from synth import TRAINER, Synth, input_pipeline
from test_analyze_findings import trainer_blocked_every
from test_python_frames import python_pipeline
from trainbpf.analyzers.job_traces import analyze_traces
from trainbpf.analyzers.pipeline import Analysis, analyze, trace_ranks
from trainbpf.reports.document import Report
from trainbpf.reports.html import render_html
from trainbpf.reports.present import culprit_lines, duration, evidence_lines, number, pct, size
from trainbpf.trace.reader import read_trace

def _evidence(page: str, key: str) -> str:
    """The text of the evidence row `key` of the page's first finding."""
    found = re.search(rf"<tr><td><code>{key}</code></td><td><pre>(.*?)</pre></td></tr>", page, re.S)
    assert found, f"no evidence row {key}"
    return html.unescape(found.group(1))


def _block_io(tmp_path: Path) -> Report:
    s = Synth()
    s.thread(TRAINER, "python")
    for x in trainer_blocked_every(s, 0.2, 0.1, state="D"):
        s.block_rq(TRAINER, x + 0.001, 0.098, size=100 << 20)
    s.gpu_from_running(TRAINER)
    return Report.of(analyze(s.read(tmp_path)))


def test_units():
    assert size(5483679744) == "5.48 GB" and size(512) == "512 B" and size(52428800) == "52.4 MB"
    assert duration(0.139) == "139 ms" and duration(6.95) == "6.95 s" and duration(2e-5) == "20 µs"
    assert pct(0.25) == "25.0%"
    assert number("handoff_share", 0.5) == "50.0%" and number("wait_p99_ms", 1.0) == "1 ms"
    assert number("faults_per_s", 1234.5) == "1.23e+03/s" and number("faults", 12) == "12"
    assert number("allocator_in_stack", True) == "yes" and number("gpu_node", None) == "—"
    assert evidence_lines("kernel_stack", "io_schedule;folio_wait_bit") == ["io_schedule", "folio_wait_bit"]
    assert evidence_lines("runnable_s", {"100": 0.05}) == ["100: 50 ms"]


def test_html_evidence_in_units(tmp_path):
    report = _block_io(tmp_path)
    finding = report.doc["findings"][0]
    assert finding["category"] == "block_io" and finding["evidence"]["bytes"] == 50 * (100 << 20)  # JSON: raw
    page = render_html(report)
    assert _evidence(page, "bytes") == "5.24 GB"
    assert "5242880000" not in page
    assert _evidence(page, "starved_s") == duration(finding["evidence"]["starved_s"])
    assert _evidence(page, "wait_p50_ms").endswith(" ms")
    assert _evidence(page, "ops") == "R: 50"


def test_html_python_frames_as_stacks(tmp_path):
    report = Report.of(analyze(read_trace(python_pipeline().write(tmp_path / "t.parquet"))))
    page = render_html(report)
    assert _evidence(page, "python_frames").splitlines() == [
        "waiter:",
        "  threading.py:331 wait  /usr/lib/python3.12/threading.py",
        "  queue.py:171 get  /usr/lib/python3.12/queue.py",
        "  train.py:54 train_step  /srv/job/train.py",
        "  train.py:80 main  /srv/job/train.py",
        "  train.py:84 <module>  /srv/job/train.py",
        "producer:",
        "  data.py:31 decode_batch  /srv/job/data.py",
        "  data.py:12 __getitem__  /srv/job/data.py",
        "  worker.py:308 _worker_loop  /opt/venv/lib/python3.12/site-packages/torch/utils/data/_utils/worker.py",
    ]
    assert '"function"' not in html.unescape(page)  # no JSON dump of the frames


def test_the_analysis_has_no_drawing_knobs():
    fields = {f.name for f in dataclasses.fields(Analysis)}
    assert not fields & {"idle", "gpu_idle_threshold"}, fields
    for function in (analyze, trace_ranks, analyze_traces):
        assert "gpu_idle_threshold" not in inspect.signature(function).parameters, function


def test_the_html_renderer_shades_by_its_own_threshold(tmp_path):
    report = Report.of(analyze(read_trace(input_pipeline().write(tmp_path / "t.parquet"))))
    low, high = render_html(report, gpu_idle_threshold=5.0), render_html(report, gpu_idle_threshold=60.0)
    assert "grey: below 5%" in low and "grey: below 60%" in high
    # The input-bound trainer keeps its GPU at 9.5-47.5%: every sample is shaded under 60, none under 5.
    assert high.count('fill="#f1f1f1"') > 0 == low.count('fill="#f1f1f1"')


def test_culprit_lines_name_tasks_as_the_cpu_line_does():
    """Every line names a task "name (tid)", its process too where known and different:
    the culprits' lines as the text report's "took the CPU" line."""
    culprits = [
        {"kind": "thread", "name": "ckpt_writer", "tid": 101, "pid": 100, "folios": 5, "function": None},
        {"kind": "process", "name": "rm", "tid": 900, "pid": 900, "bytes": 4096, "direction": "write"},
        {"kind": "process", "name": None, "tid": 901, "pid": 902, "bytes": 4096, "direction": "read"},
        {"kind": "process", "name": "rclone", "tid": 300, "pid": None, "bytes": 2000, "rate_bytes_per_s": 1000.0,
         "uploader": True, "interface": "eth0"},
    ]
    assert culprit_lines(culprits) == [
        "dirtied by: ckpt_writer (101, pid 100), 5 folios",
        "other I/O: rm (900) 4.1 kB write",
        "other I/O: ? (901, pid 902) 4.1 kB read",
        "upload: rclone (300) sent 2 kB on eth0 during the waits (1 kB/s)",
    ]
