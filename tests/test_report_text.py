"""The terminal report and `run_analyze`'s handling of options and errors."""

from __future__ import annotations

import re

import pytest

from synth import TRAINER, Synth, healthy, input_pipeline
from trainbpf.analyzers.options import Window
from trainbpf.reports.render import run_analyze
from trainbpf.trace.errors import TraceReadError, UsageError
from trainbpf.trace.spool import SpoolWriter, make_batch, spool_path_for


def test_text_report_ranks_findings(tmp_path):
    text = run_analyze(path=input_pipeline().write(tmp_path / "t.parquet"))
    assert "GPU: nvidia-smi, 100 samples; idle 71.5% of the time (1 - mean utilisation)" in text
    assert "Starved time: 7.15 s" in text
    assert "Host-bound: 0.15 s of it the trainer was busy on the CPU itself" in text
    assert "Not counted" not in text  # every wait was woken by the worker
    first = text.index(" 1. input_pipeline")
    assert text.index(" 2. host_compute") > first
    assert text.index(" 3. cpu_contention") > first
    assert "CRITICAL" in text
    assert "chain: trainer 100 [futex] <- dataloader 200 [running]" in text
    assert "do: The trainer waits for data" in text
    assert "WARNING" not in text
    # The per-thread table lists every thread with its observed time.
    table = text[text.index("Threads (seconds per state):"):]
    assert re.search(r"100\s+python\s+trainer\s+3\.00\s+0\.05\s+6\.95\s+10\.00", table)
    assert re.search(r"200\s+pt_data_worker\s+dataloader\s+10\.00", table)


def test_text_report_without_gpu_says_what_starved_means(tmp_path):
    text = run_analyze(path=healthy(gpu=False).write(tmp_path / "t.parquet"))
    assert "GPU: no GPU samples in this trace." in text
    assert "Without GPU samples, starved time is the trainer's non-running time" in text
    assert "No critical finding." in text


def test_text_report_warns_about_lost_events(tmp_path):
    s = input_pipeline(lost={"sched": 1234, "futex": 5})
    text = run_analyze(path=s.write(tmp_path / "t.parquet"))
    warning = [line for line in text.splitlines() if line.startswith("WARNING")]
    assert warning == [
        "WARNING: 1239 events were lost (futex: 5, sched: 1234): ring buffers overflowed, "
        "so the numbers below undercount what happened."
    ]
    # The warning comes before the findings, where nobody can miss it.
    assert text.index("WARNING") < text.index("Findings")


@pytest.mark.parametrize("collisions, noted", [(5, False), (10, True), (400, True)])
def test_text_report_notes_stacks_lost_to_collisions_from_one_percent(tmp_path, collisions, noted):
    s = input_pipeline(meta={"stacks": {"frames": 32, "entries": 65536, "walks": 1000, "collisions": collisions}})
    text = run_analyze(path=s.write(tmp_path / "t.parquet"))
    assert (f"NOTE: {collisions} of 1000 stack walks" in text) is noted
    assert "1. input_pipeline" in text  # the findings stand either way


def test_text_report_lost_events_from_rows_only(tmp_path):
    s = input_pipeline()
    s.lost("sched", 10, ts=1.0)
    s.lost("sched", 30, ts=2.0)  # cumulative: 30 in all
    text = run_analyze(path=s.write(tmp_path / "t.parquet"))
    assert "WARNING: 30 events were lost (sched: 30)" in text


def test_empty_trace_report(tmp_path):
    text = run_analyze(path=Synth(duration_s=5.0).write(tmp_path / "t.parquet"))
    assert "duration 5.00 s" in text
    assert "no trainer thread found" in text
    assert "This trace holds no thread activity: no events were recorded" in text
    assert "Findings" not in text


def test_empty_trace_without_clock(tmp_path):
    s = Synth(clock=False, gpu_source=None, target_pid=None)
    text = run_analyze(path=s.write(tmp_path / "t.parquet"))
    assert "duration 0.00 s" in text
    assert "This trace holds no thread activity" in text


def test_trace_with_threads_but_no_events(tmp_path):
    s = Synth(duration_s=2.0, gpu_source=None)
    s.thread(TRAINER, "python")
    text = run_analyze(path=s.write(tmp_path / "t.parquet"))
    assert "No findings: the trainer was never starved." in text


def test_unfinished_spool_is_analysed_with_a_note(tmp_path):
    out = tmp_path / "t.parquet"
    meta = dict(input_pipeline().meta)
    meta.pop("clock")
    writer = SpoolWriter(out, meta)
    writer.add(make_batch("thread", {"ts_ns": [10**12], "tid": [TRAINER], "pid": [TRAINER], "comm": ["python"], "event": ["seed"]}))
    writer.add(make_batch("offcpu", {"ts_ns": [10**12 + 10**9], "dur_ns": [10**9], "tid": [TRAINER], "pid": [TRAINER], "state": ["S"]}))
    writer.flush()  # no close, no finalize: a recorder killed mid-way
    assert spool_path_for(out).exists()
    text = run_analyze(path=out)
    assert "NOTE: the recording did not finish cleanly" in text
    assert "duration 2.00 s" in text


def test_window(tmp_path):
    path = input_pipeline().write(tmp_path / "t.parquet")
    text = run_analyze(path=path, window=Window.parse("2:5"))
    assert "duration 3.00 s (window 2-5 s of 10.00 s)" in text
    assert "Starved time: 2.15 s" in text  # 140 of every 200 ms, and 5% of the other 60 (host work)


@pytest.mark.parametrize("window", ["5:2", "abc", "1", "20:30", "-1:3", "2:2", "nan:3", "1:x"])
def test_bad_window_is_a_usage_error(tmp_path, window):
    path = input_pipeline(duration_s=10.0).write(tmp_path / "t.parquet")
    with pytest.raises(UsageError, match="bad window"):
        run_analyze(path=path, window=Window.parse(window))


def test_bad_window_tuple_is_a_usage_error(tmp_path):
    path = input_pipeline().write(tmp_path / "t.parquet")
    with pytest.raises(UsageError):
        run_analyze(path=path, window=Window(5.0, 2.0))


def test_parse_window():
    assert Window.parse("2:5") == (2.0, 5.0)
    assert Window.parse(":5") == (None, 5.0)
    assert Window.parse("2.5:") == (2.5, None)
    assert Window.parse(None) is None
    with pytest.raises(UsageError):
        Window.parse("2-5")


def test_other_usage_errors(tmp_path):
    path = input_pipeline().write(tmp_path / "t.parquet")
    with pytest.raises(UsageError, match="unknown format"):
        run_analyze(path=path, fmt="xml")
    with pytest.raises(UsageError, match="gpu-idle-threshold"):
        run_analyze(path=path, gpu_idle_threshold=150)
    with pytest.raises(UsageError, match="--trainer-tid 77"):
        run_analyze(path=path, trainer_tid=77)
    with pytest.raises(TraceReadError):
        run_analyze(path=tmp_path / "missing.parquet")


def test_output_file_and_threshold(tmp_path):
    path = input_pipeline().write(tmp_path / "t.parquet")
    out = tmp_path / "report.txt"
    text = run_analyze(path=path, output=out, gpu_idle_threshold=60.0)
    assert out.read_text() == text
    # The threshold only shades the HTML timeline: starved time does not depend on it.
    assert text == run_analyze(path=path, gpu_idle_threshold=5.0)
