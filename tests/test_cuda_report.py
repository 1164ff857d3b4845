"""CUDA in every report: the seconds of launch gap each finding explains, the JSON `cuda`
section, the text lines, and the CUDA tracks of the HTML report and the Perfetto export,
on a synthetic trace with exact numbers (tests/synth.py)."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from report_contract import validate_report
from synth import FUTEX_STACK, TRAINER, WORKER, Synth, d, input_pipeline, periodic, t
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.pipeline import analyze
from trainbpf.analyzers.timeline.cuda_calls import (
    CUDA_THREAD_COLUMNS,
    GAP_COLUMNS,
    cuda_threads,
    gpu_waits,
    in_gaps_ns,
    launch_bursts,
    launch_gaps,
)
from trainbpf.reports.document import Report, build_report
from trainbpf.reports.perfetto import CUDA_TID_BASE, GPU_PID, run_export
from trainbpf.reports.render import run_analyze
from trainbpf.reports.text import render_text

MS = 1_000_000
HELPER = 300  # a second thread that makes CUDA calls


def cuda_trainer() -> Synth:
    """Steps of 100 ms, no GPU samples: the trainer waits 30 ms on a futex for worker 200
    (data), launches 4 kernels at 30 ms, runs to 40 ms, then sleeps 50 ms inside a
    cudaStreamSynchronize (GPU-bound) and runs 10 ms.  Each launch gap runs 40 ms, from
    the synchronisation's end (90 ms) to the next step's launch (130 ms), and holds the
    next step's 30 ms data wait.  Helper 300 waits 20 ms in cudaDeviceSynchronize at 1-5 s,
    allocates once, and launches 7 kernels at 0.5 s and 7 at 5.5 s: one gap, 5.02-5.5 s."""
    s = Synth(10.0, gpu_source=None)
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    s.thread(HELPER, "pt_helper")
    for x in periodic(0.0, 10.0, 0.1):
        s.offcpu(TRAINER, x, 0.03, waker=WORKER, kstack=FUTEX_STACK)
        s.futex(TRAINER, x, 0.03, addr=0x7F00_0000_1000)
        s.add("cuda_launch", ts_ns=t(x + 0.03), dur_ns=0, tid=TRAINER, pid=TRAINER, name="runtime", op=0, count=4)
        s.offcpu(TRAINER, x + 0.04, 0.05)
        s.add("cuda_call", ts_ns=t(x + 0.04), dur_ns=d(0.05), tid=TRAINER, pid=TRAINER, name="cudaStreamSynchronize",
              state="wait", op=0)
    for x in (1.0, 2.0, 3.0, 4.0, 5.0):
        s.add("cuda_call", ts_ns=t(x), dur_ns=d(0.02), tid=HELPER, pid=TRAINER, name="cudaDeviceSynchronize",
              state="wait", op=0)
    s.add("cuda_call", ts_ns=t(0.2), dur_ns=d(0.001), tid=HELPER, pid=TRAINER, name="cudaMalloc", state="alloc", op=0)
    for x in (0.5, 5.5):
        s.add("cuda_launch", ts_ns=t(x), dur_ns=0, tid=HELPER, pid=TRAINER, name="runtime", op=0, count=7)
    return s


# --- the pure parts ---------------------------------------------------------------------


def test_in_gaps_ns_is_each_pieces_share_inside_the_gaps():
    gaps = pd.DataFrame({"tid": 1, "start_ns": np.array([10, 50]) * MS, "end_ns": np.array([20, 60]) * MS,
                         "gap_ns": 10 * MS, "wait": [0, 1]})
    pieces = pd.DataFrame({"start_ns": np.array([0, 15, 40, 55, 70]) * MS, "end_ns": np.array([12, 25, 70, 55, 80]) * MS,
                           "ns": np.array([12, 5, 30, 0, 10]) * MS})  # the second: half its length counted
    assert in_gaps_ns(pieces, gaps).tolist() == [2 * MS, 2.5 * MS, 10 * MS, 0.0, 0.0]
    empty = pd.DataFrame({c: np.zeros(0, np.int64) for c in GAP_COLUMNS})
    assert in_gaps_ns(pieces, empty).tolist() == [0.0] * 5
    assert in_gaps_ns(pieces.iloc[:0], gaps).dtype == np.float64


def test_cuda_threads_counts_inside_the_window():
    s = cuda_trainer()  # its rows as Trace.view names them
    calls = pd.DataFrame(s.rows["cuda_call"]).rename(columns={"op": "nested"})
    launch = pd.DataFrame(s.rows["cuda_launch"]).rename(columns={"op": "nested", "count": "launches", "name": "layer"})
    waits, bursts = gpu_waits(calls), launch_bursts(launch)
    gaps = launch_gaps(waits, bursts)
    whole = cuda_threads(calls, launch, waits, gaps)
    assert tuple(whole.columns) == CUDA_THREAD_COLUMNS and (whole.dtypes == np.int64).all()
    assert whole.values.tolist() == [
        [TRAINER, TRAINER, 400, 100, 5000 * MS, 99 * 40 * MS],
        [HELPER, TRAINER, 14, 5, 100 * MS, 480 * MS]]
    window = cuda_threads(calls, launch, waits, gaps, window=Span(t(2.0), t(4.0)))
    # gaps 1.99-2.03 and 3.99-4.03 clipped to 30 and 10 ms, 19 whole ones between
    assert window.values.tolist() == [[TRAINER, TRAINER, 80, 20, 1000 * MS, 800 * MS], [HELPER, TRAINER, 0, 2, 40 * MS, 0]]
    late = cuda_threads(calls, launch, waits, gaps, window=Span(t(10.0), t(11.0)))
    assert late.empty and tuple(late.columns) == CUDA_THREAD_COLUMNS and (late.dtypes == np.int64).all()


# --- the reports ---------------------------------------------------------------------------


def test_findings_gain_the_launch_gap_they_explain(tmp_path):
    a = analyze(cuda_trainer().read(tmp_path))
    assert a.uses_cuda and a.findings["launch_gap_s"].dtype == np.float64
    top = a.findings.iloc[0]
    # 100 data waits of 30 ms, starved; all but the first fall inside a launch gap
    assert top["category"] == "input_pipeline" and top["seconds"] == pytest.approx(3.0)
    assert top["launch_gap_s"] == pytest.approx(2.97)
    assert a.gpu_bound_ns == pytest.approx(5.0e9)
    # and in each of 99 gaps, 10 ms the trainer ran after its data wait: host-bound
    assert a.host_bound_ns == pytest.approx(0.99e9) and a.starved_ns == pytest.approx(3.99e9)
    without = analyze(input_pipeline().read(tmp_path, "plain.parquet"))
    assert without.cuda is None and without.findings["launch_gap_s"].isna().all()
    assert without.findings["launch_gap_s"].dtype == np.float64


def test_json_cuda_section(tmp_path):
    doc = build_report(analyze(cuda_trainer().read(tmp_path)))
    validate_report(doc)
    assert doc["schema"] == "trainbpf.report/3"
    assert doc["findings"][0]["launch_gap_s"] == 2.97
    cuda = doc["cuda"]
    assert cuda["gpu_bound_s"] == 5.0 and cuda["launch_gap_s"] == 3.96
    steps = cuda["steps"]
    # 99 steps of 100 ms from each gap's start, 40 ms of it the gap
    assert steps["count"] == 99 and len(steps["worst"]) == 5
    assert [steps[k] for k in ("per_s", "p50_ms", "p99_ms", "host_bound_share")] == pytest.approx([10.0, 100.0, 100.0, 0.4])
    worst = steps["worst"][0]
    assert worst["tid"] == TRAINER and round(worst["at_s"] * 10) == pytest.approx(worst["at_s"] * 10 + 0.1)  # at x.x9 s
    assert [worst[k] for k in ("step_ms", "host_ms", "gpu_wait_ms", "host_share")] == pytest.approx([100.0, 40.0, 50.0, 0.4])
    assert cuda["threads"] == [
        {"tid": TRAINER, "comm": "python", "launches": 400, "waits": 100, "wait_s": 5.0, "launch_gap_s": 3.96},
        {"tid": HELPER, "comm": "pt_helper", "launches": 14, "waits": 5, "wait_s": 0.1, "launch_gap_s": 0.48}]
    windowed = json.loads(run_analyze(path=tmp_path / "trace.parquet", fmt="json", window=Window.parse("2:4")))
    validate_report(windowed)
    assert [(t["launches"], t["waits"], t["launch_gap_s"]) for t in windowed["cuda"]["threads"]] == [(80, 20, 0.8), (0, 2, 0.0)]
    assert windowed["cuda"]["steps"]["count"] == 19  # the steps wholly inside 2.09-3.99 s


def test_json_without_cuda_is_null(tmp_path):
    doc = build_report(analyze(input_pipeline().read(tmp_path)))
    validate_report(doc)
    assert doc["cuda"] is None and doc["findings"] and all(f["launch_gap_s"] is None for f in doc["findings"])


def test_text_report_cuda_lines(tmp_path):
    text = render_text(Report.of(analyze(cuda_trainer().read(tmp_path))))
    assert "  GPU-bound: 5.00 s of the trainer's stalls" in text and "launch gaps 3.96 s" in text
    assert "Steps (from CUDA waits and launches): 99, 10.0/s; step time p50 100.0 ms" in text
    assert "  CUDA python (100): 400 launches, 100 GPU waits (5.00 s), launch gaps 3.96 s" in text
    assert "  CUDA pt_helper (300): 14 launches, 5 GPU waits (0.10 s), launch gaps 0.48 s" in text
    assert "    launch gaps: 2.97 s of it fell in launch gaps" in text
    plain = render_text(Report.of(analyze(input_pipeline().read(tmp_path, "plain.parquet"))))
    assert "CUDA" not in plain and "launch gap" not in plain


def _tracks(html: str) -> dict[int, Counter]:
    """Per CUDA track of the HTML report (its tid), the count of each kind of mark."""
    out = {}
    for tid, body in re.findall(r'<g class="cuda-track" data-tid="(\d+)">(.*?)</g>', html, re.S):
        out[int(tid)] = Counter(re.findall(r'<rect class="(cuda-[a-z]+)"', body))
    return out


def test_html_cuda_tracks(tmp_path):
    """400 columns of 25 ms: each trainer wait (40-90 ms of its step) marks 3 columns, each
    gap (90-130 ms) 3, each step's launches 1; the helper's 20 ms waits 1 column each,
    its gap 5.02-5.5 s 20 columns, its two launch buckets 1 each."""
    html = run_analyze(path=cuda_trainer().write(tmp_path / "t.parquet"), fmt="html")
    assert "<h2>CUDA</h2>" in html and html.count("<svg") == 3
    assert _tracks(html) == {TRAINER: Counter({"cuda-wait": 300, "cuda-gap": 297, "cuda-launch": 100}),
                             HELPER: Counter({"cuda-wait": 5, "cuda-gap": 20, "cuda-launch": 2})}
    assert "<td>pt_helper</td><td class=\"n\">14</td><td class=\"n\">5</td>" in html
    assert "<b>Launch gaps:</b> 2.97 s" in html
    plain = run_analyze(path=input_pipeline().write(tmp_path / "u.parquet"), fmt="html")
    assert "cuda-track" not in plain and "<h2>CUDA</h2>" not in plain


def test_perfetto_cuda_tracks(tmp_path):
    out = run_export(path=cuda_trainer().write(tmp_path / "t.parquet"), output=tmp_path / "t.json")
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == GPU_PID and e["tid"] >= CUDA_TID_BASE}
    assert names == {CUDA_TID_BASE: "CUDA waits: python (100)", CUDA_TID_BASE + 1: "CUDA launches: python (100)",
                     CUDA_TID_BASE + 2: "CUDA waits: pt_helper (300)", CUDA_TID_BASE + 3: "CUDA launches: pt_helper (300)"}
    slices = Counter((e["tid"], e["cat"], e["name"]) for e in events if e["ph"] == "X" and e["cat"].startswith("cuda"))
    assert slices == Counter({
        (CUDA_TID_BASE, "cuda_wait", "cudaStreamSynchronize"): 100, (CUDA_TID_BASE, "cuda_gap", "launch gap"): 99,
        (CUDA_TID_BASE + 1, "cuda_launch", "launches"): 100,
        (CUDA_TID_BASE + 2, "cuda_wait", "cudaDeviceSynchronize"): 5, (CUDA_TID_BASE + 2, "cuda_gap", "launch gap"): 1,
        (CUDA_TID_BASE + 3, "cuda_launch", "launches"): 2})
    gap = next(e for e in events if e["ph"] == "X" and e["cat"] == "cuda_gap" and e["tid"] == CUDA_TID_BASE + 2)
    assert (gap["ts"], gap["dur"]) == pytest.approx((5.02e6, 0.48e6))
    burst = next(e for e in events if e["ph"] == "X" and e["cat"] == "cuda_launch" and e["tid"] == CUDA_TID_BASE + 3)
    assert burst["args"] == {"launches": 7} and burst["ts"] == pytest.approx(0.5e6)
    # per track, slices never overlap (they would not nest in the viewer)
    for track in range(CUDA_TID_BASE, CUDA_TID_BASE + 4):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e["ph"] == "X" and e["pid"] == GPU_PID and e["tid"] == track)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
