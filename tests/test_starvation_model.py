"""The partial-utilisation starvation model (analyzers/timeline/starvation.py, docs/findings.md
"Starved time from partial utilisation"): fully idle, fully busy and partial windows,
sample periods from 100 ms to 1 s, several GPUs, GPU waits, and the error bound, on
hand-built frames and synthetic traces."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from synth import FUTEX_STACK, TRAINER, WORKER, Synth, periodic
from trainbpf.analyzers.causes.attribution import RunSplit
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.pipeline import analyze
from trainbpf.analyzers.timeline.starvation import (
    gpu_utilisation,
    idle_fraction,
    sample_windows,
    starved_pieces,
)
from trainbpf.analyzers.vocab import FUTEX_CLASS_DTYPE, RUN_CLASSES, STATE_DTYPE

MS = 1_000_000
NO_SAMPLES = RunSplit(pd.DataFrame({"tid": np.zeros(0, np.int64), "ts_ns": np.zeros(0, np.int64),
                                    "cpu": np.zeros(0, np.int64),
                                    "cls": pd.Categorical([], categories=list(RUN_CLASSES))}))


def states(*rows: tuple[int, int, str, int]) -> pd.DataFrame:
    """The trainer's state intervals (start_ms, end_ms, state, waker; -1: no waker)."""
    start, end, state, waker = zip(*rows) if rows else ((), (), (), ())
    return pd.DataFrame({
        "tid": TRAINER, "start_ns": np.array(start, np.int64) * MS, "end_ns": np.array(end, np.int64) * MS,
        "state": pd.Categorical(state, dtype=STATE_DTYPE), "waker_tid": np.array(waker, np.int64),
        "futex_class": pd.Categorical(["wait" if s == "futex" else "none" for s in state], dtype=FUTEX_CLASS_DTYPE),
    })


def windows(*rows: tuple[str, int, int, float]) -> pd.DataFrame:
    """Sample windows (gpu, start_ms, end_ms, utilisation %) as sample_windows makes them."""
    gpu, start, end, util = zip(*rows)
    util_frame = pd.DataFrame({"gpu": list(gpu), "start_ns": np.array(start, np.int64) * MS,
                               "ts_ns": np.array(end, np.int64) * MS, "util": np.array(util, float)})
    return sample_windows(util_frame, Span(0, 10**12))


def starved_ms(st_: pd.DataFrame, w: pd.DataFrame) -> tuple[float, pd.DataFrame]:
    pieces, summary = starved_pieces(st_, w, NO_SAMPLES, TRAINER)
    return float(pieces["ns"].sum()) / MS, summary


# One 100 ms sample: the trainer runs 50 ms, waits 25 ms for the worker (named), is
# runnable 5 ms (named) and sleeps 20 ms with no waker (a GPU synchronisation).
WORKED = states((0, 50, "running", -1), (50, 75, "futex", WORKER), (75, 80, "runnable", -1), (80, 100, "sleep", -1))


def test_fully_idle_window_counts_every_named_stall():
    starved, summary = starved_ms(WORKED, windows(("g", 0, 100, 0.0)))
    assert starved == pytest.approx(30.0)
    assert summary["idle_ns"].iloc[0] == pytest.approx(100 * MS)
    assert summary["unwoken_idle_ns"].iloc[0] == pytest.approx(20 * MS)  # said, not counted


def test_fully_busy_window_counts_nothing():
    starved, summary = starved_ms(WORKED, windows(("g", 0, 100, 100.0)))
    assert starved == 0.0
    assert summary["unwoken_idle_ns"].iloc[0] == 0.0


def test_worked_example_of_the_docs():
    """docs/findings.md: 40% busy, I = 60 ms; S = 30 ms all count; the unwoken sleep
    could cover 20 ms of the other 30 ms."""
    pieces, summary = starved_pieces(WORKED, windows(("g", 0, 100, 40.0)), NO_SAMPLES, TRAINER)
    by_state = pieces.groupby("state", observed=True)["ns"].sum() / MS
    assert by_state.to_dict() == pytest.approx({"futex": 25.0, "runnable": 5.0})
    assert summary["unwoken_idle_ns"].iloc[0] == pytest.approx(20 * MS)
    # Waiting 80 ms instead: S = 85 ms > I = 60 ms, each piece counts 60/85 of itself.
    longer = states((0, 15, "running", -1), (15, 95, "futex", WORKER), (95, 100, "runnable", -1))
    pieces, _ = starved_pieces(longer, windows(("g", 0, 100, 40.0)), NO_SAMPLES, TRAINER)
    by_state = pieces.groupby("state", observed=True)["ns"].sum() / MS
    assert by_state.to_dict() == pytest.approx({"futex": 80 * 60 / 85, "runnable": 5 * 60 / 85})


def test_several_gpus_weigh_the_same():
    """Per GPU, then averaged: an idle GPU and a busy one make half the starved time."""
    both = windows(("a", 0, 100, 0.0), ("b", 0, 100, 100.0))
    starved, summary = starved_ms(WORKED, both)
    assert starved == pytest.approx(15.0)
    assert set(summary["weight"]) == {0.5}
    util = pd.DataFrame({"gpu": ["a", "b"], "start_ns": [0, 0], "ts_ns": [100 * MS] * 2, "util": [0.0, 100.0]})
    assert idle_fraction(util, Span(0, 100 * MS)) == pytest.approx(0.5)
    # Two GPUs at 40% and 70%: 30 of a's 60 ms idle, and b's 30 ms idle covers 30 of the
    # 30 ms of named stalls: (30 + 30) / 2.
    starved, _ = starved_ms(WORKED, windows(("a", 0, 100, 40.0), ("b", 0, 100, 70.0)))
    assert starved == pytest.approx(30.0)
    starved, _ = starved_ms(WORKED, windows(("a", 0, 100, 40.0), ("b", 0, 100, 90.0)))
    assert starved == pytest.approx((30.0 + 10.0) / 2)


def test_nvml_sample_periods_come_from_dur_ns():
    """Driver samples carry their own period; nvidia-smi's come from the spacing."""
    gpu = pd.DataFrame({"ts_ns": np.array([1167, 1334, 1600], np.int64) * MS, "dur_ns": np.array([167, 167, 100], np.int64) * MS,
                        "index": 0, "util_pct": [50.0, 50.0, 50.0], "uuid": "GPU-0", "pid": pd.array([None] * 3, dtype="Int32")})
    util = gpu_utilisation(gpu, Span(0, 10**12))
    assert (util["ts_ns"] - util["start_ns"]).tolist() == [167 * MS, 167 * MS, 100 * MS]
    smi = gpu.drop(columns=["dur_ns"])
    spaced = gpu_utilisation(smi, Span(0, 10**12))
    # The first sample covers the median spacing, (167 + 266) / 2 ms.
    assert (spaced["ts_ns"] - spaced["start_ns"]).tolist() == [216_500_000, 167 * MS, 266 * MS]


def test_only_the_jobs_processes_count_on_a_shared_gpu():
    """Per-process rows (NVML): the job's own utilisation, not the neighbour's."""
    rows = [(100, 100, None, 90.0), (100, 100, 1234, 30.0), (100, 100, 999, 60.0),
            (200, 100, None, 90.0), (200, 100, 1234, 30.0), (200, 100, 999, 60.0)]
    ts, dur, pid, value = zip(*rows)
    gpu = pd.DataFrame({"ts_ns": np.array(ts, np.int64) * MS, "dur_ns": np.array(dur, np.int64) * MS, "op": 0,
                        "value": value, "name": "GPU-0", "pid": pd.array(pid, dtype="Int32")})
    assert gpu_utilisation(gpu, Span(0, 10**12))["util"].tolist() == [90.0, 90.0]  # pids unknown: the device
    mine = gpu_utilisation(gpu, Span(0, 10**12), pids=frozenset({1234}))
    assert mine["util"].tolist() == [30.0, 30.0]


def step_trace(*, wait: float, host: float, gpu: float, lag: float = 0.0, period: float = 0.1,
               seconds: float = 6.0) -> tuple[Synth, float, float]:
    """A trainer that each step waits `wait` s for the worker (named), does `host` s of
    host work, then sleeps (no waker) through `gpu` s of GPU work; after its last step it
    runs to the end (host work too).  The GPU is busy during its work and, with `lag`,
    also the first `lag` s of each wait (work queued ahead).  Samples every `period` s
    report the exact busy share.  Returns the trace, the true starved seconds (waits and
    host work overlapping idle time) and the sum of the per-window error bounds
    min(C, I, p - C, p - I), C the waits and host work in the window."""
    s = Synth(seconds)
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    step = wait + host + gpu
    busy, work = [], []
    x = 0.0
    for x in periodic(0.0, seconds - step, step):
        s.offcpu(TRAINER, x, wait, waker=WORKER, kstack=FUTEX_STACK)
        s.offcpu(TRAINER, x + wait + host, gpu, state="S")  # a synchronisation no thread ends
        work += [(x, x + wait), (x + wait, x + wait + host)]
        busy.append((x + wait + host, x + step))
        if lag:
            busy.append((x, x + min(lag, wait)))
    work.append((x + step, seconds))
    edges = np.arange(0.0, seconds + 1e-9, period)

    def overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
        return sum(max(0.0, min(b, e) - max(a, s_)) for s_, e in spans)

    truth = bound = 0.0
    for a, b in zip(edges[:-1], edges[1:]):
        used = overlap(a, b, busy)
        s.gpu(b, 100.0 * used / (b - a))
        idle, candidates, p = (b - a) - used, overlap(a, b, work), b - a
        inside = [(max(a, s_), min(b, e)) for s_, e in work if e > a and s_ < b]
        truth += sum(e - s_ - overlap(s_, e, busy) for s_, e in inside)  # stalls and host work while the GPU idled
        bound += min(candidates, idle, p - candidates, p - idle)
    return s, truth, bound


@pytest.mark.parametrize("period", [0.1, 0.167, 0.5, 1.0])
def test_step_scale_stalls_are_exact_at_any_sample_period(tmp_path, period):
    """Waits of 20 ms inside 45 ms steps, the GPU partly busy in every sample: the
    threshold model saw nothing; this one finds all of it, whatever the period."""
    s, truth, _ = step_trace(wait=0.02, host=0.005, gpu=0.02, period=period)
    a = analyze(s.read(tmp_path))
    assert a.starved_ns / 1e9 == pytest.approx(truth, rel=0.01)
    assert truth > 0.5 * 6.0 * 0.9  # 25 of every 45 ms
    assert a.findings.iloc[0]["category"] == "input_pipeline"
    assert a.findings.iloc[0]["severity"] == "critical"
    # The idle time left after the waits is the trainer's host work (5 of 45 ms), which
    # comes before the unwoken sleeps: nothing is left for them to cover.
    assert a.host_bound_ns / 1e9 == pytest.approx(truth - a.findings.iloc[0]["seconds"], rel=0.01)
    assert a.unwoken_idle_ns < 1e-3 * a.window.ns


@settings(max_examples=25, deadline=None)
@given(wait=st.floats(0.002, 0.08), host=st.floats(0.0, 0.04), gpu=st.floats(0.005, 0.08),
       lag=st.floats(0.0, 0.02), period=st.sampled_from([0.1, 0.167, 0.25, 0.5, 1.0]))
def test_estimate_lies_within_its_error_bound(tmp_path_factory, wait, host, gpu, lag, period):
    """The estimate is never below the truth and never above it by more than the sum of
    the per-window bounds; without work queued ahead (no lag) it is exact."""
    s, truth, bound = step_trace(wait=wait, host=host, gpu=gpu, lag=lag, period=period, seconds=3.0)
    a = analyze(s.read(tmp_path_factory.mktemp("t")))
    est = a.starved_ns / 1e9
    tol = 1e-6 * 3.0 + 2e-9 * len(s.rows["offcpu"])
    assert truth - tol <= est <= truth + bound + tol
    if lag == 0.0:
        assert est == pytest.approx(truth, abs=tol)


def test_gpu_bound_trainer_has_no_critical_finding(tmp_path):
    """GPU 95% busy; the trainer launches for 2 ms and then waits 40 ms in a blocking
    synchronisation (a sleep no thread ends), now and then 1 ms for the worker."""
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    for k, x in enumerate(periodic(0.0, s.duration_s - 0.05, 0.042)):
        if k % 12 == 0:
            s.offcpu(TRAINER, x + 0.0005, 0.001, waker=WORKER, kstack=FUTEX_STACK)
        s.offcpu(TRAINER, x + 0.002, 0.04, state="S")
    s.gpu_series(lambda ts: 95.0)
    a = analyze(s.read(tmp_path))
    assert a.idle_fraction == pytest.approx(0.05)
    # its stalls explain almost nothing; its launches (host work) at most the 5% idle
    assert a.starved_ns - a.host_bound_ns < 0.01 * a.window.ns
    assert a.host_bound_ns <= a.idle_ns + 1.0
    assert not (a.findings["severity"] == "critical").any()


def test_exact_run_rows_of_zero_length_name_nothing():
    """A reclaim row without a duration (null or 0) names no running time and breaks
    nothing (hypothesis found an IndexError here)."""
    reclaim = pd.DataFrame({"ts_ns": [50 * MS, 60 * MS], "dur_ns": [0, None], "tid": [1, 1]})
    no_samples = pd.DataFrame({"tid": np.zeros(0, np.int64), "ts_ns": np.zeros(0, np.int64),
                               "cpu": np.zeros(0, np.int64), "cls": pd.Categorical([], categories=list(RUN_CLASSES))})
    split = RunSplit(no_samples, exact={"reclaim": reclaim})
    shares = split.fractions(1, np.array([0]), np.array([100 * MS]))
    assert shares.shape == (1, len(RUN_CLASSES))
    assert shares[0, 0] == 1.0 and shares[0, 1:].sum() == 0.0


def test_cuda_waits_make_gpu_bound_time_exact():
    """With the CUDA probe's waits, the worked example's sleep inside a synchronisation
    (80-100 ms) is GPU-bound: neither starved nor "not counted".  A sleep outside any
    wait is then no GPU wait but a stall: a 10 ms timer sleep at 40-50 ms counts."""
    from trainbpf.analyzers.timeline.cuda_calls import split_at_waits

    timer = states((0, 40, "running", -1), (40, 50, "sleep", -1), (50, 75, "futex", WORKER),
                   (75, 80, "runnable", -1), (80, 100, "sleep", -1))
    sync = pd.DataFrame({"tid": [TRAINER], "start_ns": [78 * MS], "end_ns": [100 * MS]})
    cut = split_at_waits(timer, sync)
    pieces, summary = starved_pieces(cut, windows(("g", 0, 100, 40.0)), NO_SAMPLES, TRAINER)
    by_state = pieces.groupby("state", observed=True)["ns"].sum() / MS
    # named: 10 ms timer sleep + 25 ms futex + 3 ms runnable outside the wait = 38 <= I = 60
    assert by_state.to_dict() == pytest.approx({"sleep": 10.0, "futex": 25.0, "runnable": 3.0})
    assert summary["gpu_bound_ns"].iloc[0] == pytest.approx(22 * MS)  # 2 ms runnable + 20 ms sleep
    assert summary["unwoken_ns"].iloc[0] == 0.0 and summary["unwoken_idle_ns"].iloc[0] == 0.0
    # pieces still name the trainer's state rows (the chains and findings look them up)
    assert set(pieces["interval"]) == {1, 2, 3}
    # Without the waits, both sleeps are presumed GPU waits: only futex + runnable count.
    plain, plain_summary = starved_pieces(timer, windows(("g", 0, 100, 40.0)), NO_SAMPLES, TRAINER)
    assert float(plain["ns"].sum()) / MS == pytest.approx(30.0)
    assert plain_summary["gpu_bound_ns"].iloc[0] == 0.0


def test_launch_gaps_lift_a_windows_idle_to_the_stalls_inside_them():
    """A sample's average can put a step's idle time in the neighbouring window.  With
    the trainer's exact launch gaps, a window's idle time is at least its named stalls
    inside them: a 30 ms data wait inside a gap counts whole in a window sampled 90 %
    busy (I = 10 ms), while a wait outside any gap stays capped."""
    from trainbpf.analyzers.timeline.cuda_calls import split_at_waits

    trainer = states((0, 10, "running", -1), (10, 40, "futex", WORKER), (40, 60, "running", -1),
                     (60, 100, "sleep", -1), (100, 110, "running", -1), (110, 140, "futex", WORKER),
                     (140, 200, "running", -1))
    sync = pd.DataFrame({"tid": [TRAINER], "start_ns": [60 * MS], "end_ns": [100 * MS]})
    cut = split_at_waits(trainer, sync)
    # the gap from the wait's end (0 ms: an earlier one) to the next launch at 45 ms
    gaps = pd.DataFrame({"tid": [TRAINER], "start_ns": [0], "end_ns": [45 * MS], "gap_ns": [45 * MS], "wait": [0]})
    busy = windows(("g", 0, 100, 90.0), ("g", 100, 200, 90.0))
    pieces, summary = starved_pieces(cut, busy, NO_SAMPLES, TRAINER, gaps=gaps)
    assert summary["idle_ns"].to_numpy() / MS == pytest.approx([30.0, 10.0])
    assert summary["starved_ns"].to_numpy() / MS == pytest.approx([30.0, 10.0])  # the second wait: no gap
    assert float(pieces["ns"].sum()) / MS == pytest.approx(40.0)
    # Without the gaps both windows are capped at the sampled 10 ms.
    plain, _ = starved_pieces(cut, busy, NO_SAMPLES, TRAINER)
    assert float(plain["ns"].sum()) / MS == pytest.approx(20.0)
