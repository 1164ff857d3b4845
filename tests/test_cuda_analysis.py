"""analyzers/timeline/cuda_calls.py: unit tests on small synthetic frames, and one recording of a
fine-grained trainer on the stand-in CUDA libraries (tests/cuda_workloads.py) whose
GPU-bound and data-wait time, steps and step time must match the simulated truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kernel_env import require_root
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.pipeline import analyze
from trainbpf.analyzers.timeline.cuda_calls import (
    BURST_COLUMNS,
    GAP_COLUMNS,
    STEP_COLUMNS,
    WAIT_COLUMNS,
    gpu_bound_ns,
    gpu_waits,
    launch_bursts,
    launch_gaps,
    split_at_waits,
    step_summary,
    steps,
)

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[1]


def calls(*rows) -> pd.DataFrame:
    """rows: (tid, ts_ms, dur_ms, name, state, nested) as Trace.view("cuda_call") names them."""
    cols = ("tid", "ts_ns", "dur_ns", "name", "state", "nested")
    frame = pd.DataFrame(list(rows), columns=cols)
    frame["ts_ns"] = (frame["ts_ns"] * MS).round().astype(np.int64)
    frame["dur_ns"] = (frame["dur_ns"] * MS).round().astype(np.int64)
    frame["pid"] = frame["tid"]
    return frame


def launches(*rows) -> pd.DataFrame:
    """rows: (tid, ts_ms, dur_ms, nested, launches) as Trace.view("cuda_launch") names them."""
    frame = pd.DataFrame(list(rows), columns=("tid", "ts_ns", "dur_ns", "nested", "launches"))
    frame["ts_ns"] = (frame["ts_ns"] * MS).round().astype(np.int64)
    frame["dur_ns"] = (frame["dur_ns"] * MS).round().astype(np.int64)
    frame["pid"] = 1
    frame["layer"] = "runtime"
    return frame


EMPTY_CALLS = calls().astype({"tid": "Int64", "nested": "Int64", "name": object, "state": object})
EMPTY_LAUNCHES = launches().astype({"tid": "Int64", "nested": "Int64", "launches": "Int64"})


def test_empty_frames_keep_columns_and_dtypes():
    waits, bursts = gpu_waits(EMPTY_CALLS), launch_bursts(EMPTY_LAUNCHES)
    assert tuple(waits.columns) == WAIT_COLUMNS and tuple(bursts.columns) == BURST_COLUMNS
    gaps, rows = launch_gaps(waits, bursts), steps(waits, bursts)
    assert tuple(gaps.columns) == GAP_COLUMNS and tuple(rows.columns) == STEP_COLUMNS
    for frame in (waits, bursts, gaps, rows):
        assert len(frame) == 0
    assert waits["start_ns"].dtype == np.int64 and bursts["launches"].dtype == np.int64
    assert gaps["gap_ns"].dtype == np.int64 and rows["host_share"].dtype == np.float64
    assert step_summary(rows)["steps"] == 0 and step_summary(rows)["worst"] == []
    states = pd.DataFrame({"start_ns": np.zeros(0, np.int64), "end_ns": np.zeros(0, np.int64), "state": []})
    assert len(split_at_waits(states, waits)) == 0 and len(gpu_bound_ns(states, waits)) == 0


def test_nested_runtime_and_driver_calls_count_once():
    frame = calls(
        (7, 10, 5, "cudaStreamSynchronize", "wait", 0), (7, 10.01, 4.98, "cuStreamSynchronize", "wait", 1),
        (7, 20, 3, "cudaMemcpy", "copy", 0), (7, 20.02, 2.9, "cuMemcpy", "copy", 1),
        (7, 30, 2, "cudaMemcpyAsync", "copy", 0), (7, 30.01, 1, "cuMemcpyHtoD", "copy", 1),  # a blocking copy inside
        (7, 40, 2, "cuMemcpyDtoHAsync", "copy", 0), (7, 50, 1, "cudaMalloc", "alloc", 0),
        (7, 60, 4, "cuCtxSynchronize", "wait", 0),  # a direct driver wait
    )
    waits = gpu_waits(frame)
    assert list(waits["name"]) == ["cudaStreamSynchronize", "cudaMemcpy", "cuMemcpyHtoD", "cuCtxSynchronize"]
    assert (waits["end_ns"] - waits["start_ns"]).sum() == (5 + 3 + 1 + 4) * MS
    assert (waits["tid"] == 7).all() and (waits["pid"] == 7).all()


def test_synchronous_frees_are_waits_and_async_frees_are_not():
    frame = calls(
        (7, 10, 5, "cudaFree", "free", 0), (7, 10.01, 4.9, "cuMemFree", "free", 1),  # runtime over driver
        (7, 20, 2, "cuMemFreeHost", "free", 0), (7, 30, 3, "cuMemFreeAsync", "free", 0),
        (7, 40, 1, "cudaFreeAsync", "free", 0), (7, 50, 4, "cuMemFree", "free", 0),
    )
    waits = gpu_waits(frame)
    assert list(waits["name"]) == ["cudaFree", "cuMemFreeHost", "cuMemFree"], "synchronous frees must be GPU waits"
    assert (waits["end_ns"] - waits["start_ns"]).sum() == (5 + 2 + 4) * MS


def test_partly_overlapping_calls_keep_the_later_part():
    waits = gpu_waits(calls((3, 10, 5, "cudaDeviceSynchronize", "wait", 0), (3, 12, 6, "cuEventSynchronize", "wait", 1)))
    assert list(zip(waits.start_ns, waits.end_ns)) == [(10 * MS, 15 * MS), (15 * MS, 18 * MS)]


def test_waits_of_several_threads_and_the_tid_filter():
    frame = calls((2, 10, 5, "cudaStreamSynchronize", "wait", 0), (1, 12, 5, "cudaStreamSynchronize", "wait", 0),
                  (1, 0, 1, "cudaDeviceSynchronize", "wait", 0))
    waits = gpu_waits(frame)
    assert list(zip(waits.tid, waits.start_ns)) == [(1, 0), (1, 12 * MS), (2, 10 * MS)]  # overlap across threads kept
    assert list(gpu_waits(frame, tids={2}).tid) == [2]
    assert len(gpu_waits(frame, tids=[])) == 0


def test_bursts_merge_touching_rows_per_thread_and_skip_nested():
    frame = launches((1, 0, 10, 0, 5), (1, 10, 10, 0, 3), (1, 10, 10, 1, 3), (1, 40, 10, 0, 2),
                     (2, 10, 10, 0, 4), (2, 50, 0, 0, 1))  # thread 2: one exact launch at 50 ms
    bursts = launch_bursts(frame)
    assert bursts[["tid", "start_ns", "end_ns", "launches"]].values.tolist() == [
        [1, 0, 20 * MS, 8], [1, 40 * MS, 50 * MS, 2], [2, 10 * MS, 20 * MS, 4], [2, 50 * MS, 50 * MS, 1]]
    assert len(launch_bursts(frame, join_ns=20 * MS, tids=[1])) == 1
    assert launch_bursts(frame, tids=[2])["launches"].sum() == 5


def rhythm(n: int, *, host_ms: float = 12, gpu_ms: float = 20, tid: int = 1, t0: float = 0.0):
    """n steps of one thread: a wait of gpu_ms, then host_ms later one exact burst of 3
    launches lasting 0.1 ms, then the next wait."""
    c, b = [], []
    t = t0
    for _ in range(n):
        t += host_ms
        b.append((tid, t, 0.1, 0, 3))
        t += 0.1
        c.append((tid, t, gpu_ms, "cudaStreamSynchronize", "wait", 0))
        c.append((tid, t + 0.01, gpu_ms - 0.02, "cuStreamSynchronize", "wait", 1))
        t += gpu_ms
    return calls(*c), launches(*b)


def test_gaps_and_steps_from_an_exact_rhythm():
    c, b = rhythm(10)
    waits, bursts = gpu_waits(c), launch_bursts(b)
    gaps = launch_gaps(waits, bursts)
    assert len(gaps) == 9 and (gaps["gap_ns"] == 12 * MS).all()  # the last wait: no launch after it
    assert (gaps["start_ns"].to_numpy() == waits["end_ns"].to_numpy()[:9]).all()
    rows = steps(waits, bursts)
    assert len(rows) == 9  # the last ends at the last wait's end
    assert (rows["step_ns"] == int(32.1 * MS)).all() and (rows["host_ns"] == 12 * MS).all()
    assert (rows["gpu_wait_ns"] == 20 * MS).all() and (rows["launches"] == 3).all()
    assert np.allclose(rows["host_share"], 12 / 32.1)
    summary = step_summary(rows, worst=2)
    assert summary["steps"] == 9 and summary["step_p50_s"] == pytest.approx(0.0321)
    assert summary["steps_per_s"] == pytest.approx(1 / 0.0321)
    assert summary["host_bound_share"] == pytest.approx(12 / 32.1) and len(summary["worst"]) == 2
    inside = steps(waits, bursts, window=Span(int(rows.start_ns[2]), int(rows.end_ns[5])))
    assert list(inside.start_ns) == list(rows.start_ns[2:6])


def test_bucketed_launches_bound_the_gap_by_the_bucket():
    """10 ms buckets: a bucket that began inside the host gap gives the gap up to its
    start; one straddling the wait's end gives a gap of 0, never a negative one."""
    waits = gpu_waits(calls((1, 0, 13, "cudaStreamSynchronize", "wait", 0), (1, 40, 10, "cudaStreamSynchronize", "wait", 0),
                            (1, 75, 10, "cudaStreamSynchronize", "wait", 0)))
    bursts = launch_bursts(launches((1, 10, 10, 0, 2), (1, 60, 10, 0, 2)))
    gaps = launch_gaps(waits, bursts)
    assert gaps[["start_ns", "end_ns", "gap_ns", "wait"]].values.tolist() == [
        [13 * MS, 13 * MS, 0, 0], [50 * MS, 60 * MS, 10 * MS, 1]]  # the third wait: nothing after it


def test_waits_without_launches_and_waits_in_a_row():
    c = calls((1, 0, 5, "cudaDeviceSynchronize", "wait", 0), (1, 6, 5, "cudaMemcpy", "copy", 0),
              (1, 20, 5, "cudaDeviceSynchronize", "wait", 0), (1, 40, 5, "cudaDeviceSynchronize", "wait", 0))
    b = launches((1, 15, 0, 0, 1), (1, 30, 0, 0, 1))
    waits, bursts = gpu_waits(c), launch_bursts(b)
    gaps = launch_gaps(waits, bursts)
    assert gaps[["start_ns", "gap_ns", "wait"]].values.tolist() == [[11 * MS, 4 * MS, 1], [25 * MS, 5 * MS, 2]]
    rows = steps(waits, bursts)
    assert rows[["start_ns", "end_ns", "gpu_wait_ns", "launches"]].values.tolist() == [
        [11 * MS, 25 * MS, 5 * MS, 1], [25 * MS, 45 * MS, 5 * MS, 1]]
    one = gpu_waits(calls((1, 0, 5, "cudaDeviceSynchronize", "wait", 0)))
    assert len(steps(one, launch_bursts(launches((1, 7, 0, 0, 1))))) == 0  # launched, never waited: open
    assert len(steps(waits, launch_bursts(EMPTY_LAUNCHES))) == 0  # waits alone: no rhythm
    assert len(launch_gaps(gpu_waits(EMPTY_CALLS), bursts)) == 0  # launches alone: no gap


def test_steps_of_several_threads_stay_apart():
    c1, b1 = rhythm(5, tid=1)
    c2, b2 = rhythm(4, tid=2, host_ms=3, gpu_ms=7, t0=1.0)
    waits, bursts = gpu_waits(pd.concat([c1, c2])), launch_bursts(pd.concat([b1, b2]))
    rows = steps(waits, bursts)
    assert rows.groupby("tid").size().to_dict() == {1: 4, 2: 3}
    assert set(rows[rows.tid == 2].host_ns) == {3 * MS} and set(rows[rows.tid == 1].gpu_wait_ns) == {20 * MS}


def test_split_at_waits_tiles_each_interval():
    waits = gpu_waits(calls((1, 10, 10, "cudaStreamSynchronize", "wait", 0), (1, 30, 5, "cudaMemcpy", "copy", 0),
                            (2, 0, 100, "cudaDeviceSynchronize", "wait", 0)))
    states = pd.DataFrame({"tid": [1, 1, 1, 3], "start_ns": np.array([0, 25, 50, 0]) * MS,
                           "end_ns": np.array([25, 40, 60, 10]) * MS, "state": ["sleep", "futex", "sleep", "sleep"],
                           "waker_tid": [-1, 9, -1, -1]})
    pieces = split_at_waits(states, waits)
    assert pieces[["interval", "start_ns", "end_ns", "in_wait"]].values.tolist() == [
        [0, 0, 10 * MS, False], [0, 10 * MS, 20 * MS, True], [0, 20 * MS, 25 * MS, False],
        [1, 25 * MS, 30 * MS, False], [1, 30 * MS, 35 * MS, True], [1, 35 * MS, 40 * MS, False],
        [2, 50 * MS, 60 * MS, False], [3, 0, 10 * MS, False]]  # thread 3 meets no wait of thread 2
    assert list(pieces.waker_tid) == [-1, -1, -1, 9, 9, 9, -1, -1] and list(pieces.columns[:5]) == list(states.columns)
    assert list(gpu_bound_ns(states, waits)) == [10 * MS, 5 * MS, 0, 0]
    # without a tid column every wait counts
    assert list(gpu_bound_ns(states.drop(columns="tid"), waits)) == [25 * MS, 15 * MS, 10 * MS, 10 * MS]


# --- the fine-grained trainer, recorded ------------------------------------------------


def _fake_cuda_build():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_cuda_build", ROOT / "scripts" / "fake-cuda" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sim_gpu_file_gets_each_kernel(tmp_path):
    """With $TRAINBPF_SIM_GPU the stand-in device writes each kernel's busy interval and
    its pid, the format the nvidia-smi and NVML stand-ins read; copies are not kernels."""
    runtime = _fake_cuda_build().build(tmp_path / "wheel")
    sim = tmp_path / "sim-gpu"
    script = (f"import ctypes, os, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
              "from kernel_workloads import Dim3; "
              f"rt = ctypes.CDLL({str(runtime)!r}); one = Dim3(1, 1, 1); "
              "[rt.cudaLaunchKernel(None, one, one, None, ctypes.c_size_t(0), None) for _ in range(3)]; "
              "rt.cudaMemcpyAsync(None, None, ctypes.c_size_t(10**6), 1, None); rt.cudaDeviceSynchronize(); "
              "print(os.getpid())")
    env = {"PATH": "/usr/bin:/bin", "TRAINBPF_SIM_GPU": str(sim), "FAKECUDA_KERNEL_NS": "2000000"}
    pid = int(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             check=True).stdout)
    lines = [tuple(map(int, ln.split())) for ln in sim.read_text().splitlines()]
    assert len(lines) == 3 and all(p == pid and e - s == 2 * MS for s, e, p in lines)
    assert all(lines[i][1] <= lines[i + 1][0] for i in range(2))  # one queue: back to back
    assert (tmp_path / "sim-gpu.pids").read_text() == f"{pid}\n"
    del env["TRAINBPF_SIM_GPU"]
    subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
    assert len(sim.read_text().splitlines()) == 3  # without it nothing is written


def _within(measured: float, truth: float, share: float = 0.05) -> bool:
    return abs(measured - truth) <= share * truth


def _recorded(tmp_path: Path, *workload_args: str, gpu: str = "nvidia-smi", probes: str = "sched,futex,cuda"):
    """The stand-in CUDA trainer (tests/cuda_workloads.py) recorded: its truth and the trace."""
    from scenario_harness import fake_gpu_env, trainbpf_cli
    from trainbpf.trace.reader import read_trace
    from trainbpf.trace.spool import spool_path_for

    runtime = _fake_cuda_build().build(tmp_path / "wheel")
    env = fake_gpu_env(tmp_path)
    trace, truth_file = tmp_path / "trace.parquet", tmp_path / "truth.json"
    workload = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "cuda_workloads.py"), "--runtime", str(runtime), "--truth", str(truth_file),
         "--hold-until", str(spool_path_for(trace)), "--seconds", "5", *workload_args],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert workload.stdout.readline().strip() == f"ready pid={workload.pid}"
        recorded = subprocess.run([str(trainbpf_cli()), "record", "--pid", str(workload.pid), "--duration", "120",
                                   "--gpu", gpu, "--probes", probes, "-o", str(trace)],
                                  env=env, capture_output=True, text=True, timeout=240)
        assert recorded.returncode == 0, recorded.stderr
        assert workload.wait(timeout=30) == 0
    finally:
        if workload.poll() is None:
            workload.kill()
            workload.wait()
    return json.loads(truth_file.read_text()), read_trace(trace)


@pytest.mark.kernel
def test_launch_gaps_filled_by_host_work_without_gpu_samples(tmp_path):
    """Issue 35, the CUDA variant: batches are ready at once and the trainer spends 15 ms
    of CPU in `optimizer_step` after every synchronisation.  Without any GPU sample, the
    launch gaps alone make that host-bound time: host_compute on top, the function named,
    its seconds within 10% of the CPU time spent there, and the starved time (that and
    the preemptions inside the gaps) within 10% of the wall time."""
    require_root()
    truth, data = _recorded(tmp_path, "--host-ms", "15", gpu="off", probes="sched,futex,cuda,oncpu")
    trainer = truth["trainer"]
    whole = analyze(data, trainer_tid=trainer)
    lo, hi = truth["steps"][0][0], truth["steps"][-1][1]
    a = analyze(data, trainer_tid=trainer, window=_seconds_window(whole, lo, hi))
    print(f"\nhost-bound s: truth {truth['host_ns'] / 1e9:.3f} measured {a.host_bound_ns / 1e9:.3f}; "
          f"starved s {a.starved_ns / 1e9:.3f}; findings {a.findings[['category', 'seconds']].values.tolist()}")
    assert a.basis == "trainer_not_running" and a.uses_cuda
    cpu_ns = 15e6 * len(truth["host"])
    assert _within(a.host_bound_ns, cpu_ns, 0.1), (a.host_bound_ns, cpu_ns)
    assert _within(a.starved_ns, truth["host_ns"], 0.1), (a.starved_ns, truth["host_ns"])
    top = a.findings.iloc[0]
    assert top.category == "host_compute", a.findings
    assert top.evidence["functions"][0]["function"] == "optimizer_step", top.evidence


@pytest.mark.kernel
def test_fine_grained_trainer_matches_the_truth(tmp_path):
    """The trainer alternates data waits (GPU idle) and stream synchronisations (GPU
    busy) in 25-55 ms steps.  From the recorded trace alone: the trainer's off-CPU time
    inside GPU waits is its GPU-bound time, the rest its data waits (starved), each
    within 5% of the truth, and so are the step count and the step time p50."""
    require_root()
    truth, data = _recorded(tmp_path)
    trainer = truth["trainer"]
    waits = gpu_waits(data.view("cuda_call"), tids=[trainer])
    bursts = launch_bursts(data.view("cuda_launch"), tids=[trainer])
    lo, hi = truth["steps"][0][0], truth["steps"][-1][1]

    offcpu = data.frame("offcpu")
    offcpu = offcpu[offcpu["tid"] == trainer]
    ts = offcpu["ts_ns"].to_numpy(np.int64)
    start, end = np.clip(ts, lo, hi), np.clip(ts + offcpu["dur_ns"].to_numpy(np.int64), lo, hi)
    states = pd.DataFrame({"tid": trainer, "start_ns": start, "end_ns": end, "state": offcpu["state"].to_numpy()})
    states = states[states["end_ns"] > states["start_ns"]]
    gpu_bound = int(gpu_bound_ns(states, waits).sum())
    starved = int((states["end_ns"] - states["start_ns"]).sum()) - gpu_bound

    rows = steps(waits, bursts, window=Span(lo, hi))
    summary = step_summary(rows)
    truth_p50 = float(np.median([e - s for s, e in truth["steps"]])) / 1e9
    gpu = data.frame("gpu")
    in_window = gpu[(gpu["ts_ns"] > lo + 100 * MS) & (gpu["ts_ns"] <= hi)]
    util = float(pd.to_numeric(in_window["value"]).mean()) / 100
    busy = truth["gpu_busy_ns"] / (hi - lo)
    print(f"\nGPU-bound s: truth {truth['sync_ns'] / 1e9:.3f} measured {gpu_bound / 1e9:.3f}; "
          f"data wait s: truth {truth['data_wait_ns'] / 1e9:.3f} measured {starved / 1e9:.3f}; "
          f"steps: truth {truth['step_count']} measured {summary['steps']}; "
          f"step p50 ms: truth {truth_p50 * 1e3:.2f} measured {summary['step_p50_s'] * 1e3:.2f}; "
          f"host-bound share: truth {truth['data_wait_ns'] / (hi - lo):.3f} measured {summary['host_bound_share']:.3f}; "
          f"GPU busy: truth {busy:.3f} nvidia-smi {util:.3f} ({len(in_window)} samples)")
    assert _within(gpu_bound, truth["sync_ns"]), (gpu_bound, truth["sync_ns"])
    assert _within(starved, truth["data_wait_ns"]), (starved, truth["data_wait_ns"])
    assert _within(summary["steps"], truth["step_count"]), (summary["steps"], truth["step_count"])
    assert _within(summary["step_p50_s"], truth_p50), (summary["step_p50_s"], truth_p50)
    # launch gaps run to each bucket's first launch, exact: the host-bound share is the data waits'
    assert _within(summary["host_bound_share"], truth["data_wait_ns"] / (hi - lo)), summary["host_bound_share"]
    # the stand-in's kernels are the simulated GPU that nvidia-smi's stand-in samples
    assert len(in_window) >= 20 and abs(util - busy) < 0.1, (util, busy)

    # The whole analysis over the steps: the estimator leaves the GPU waits out of the
    # starved time (GPU-bound) and counts the data waits against the samples' idle time.
    whole = analyze(data, trainer_tid=trainer)
    analysis = analyze(data, trainer_tid=trainer, window=_seconds_window(whole, lo, hi))
    print(f"analysis: GPU-bound s {analysis.gpu_bound_ns / 1e9:.3f}, starved s {analysis.starved_ns / 1e9:.3f}, "
          f"steps {analysis.cuda_steps['steps']}, not counted s {analysis.unwoken_idle_ns / 1e9:.3f}")
    assert analysis.uses_cuda and analysis.unwoken_idle_ns == 0.0
    assert _within(analysis.gpu_bound_ns, truth["sync_ns"]), (analysis.gpu_bound_ns, truth["sync_ns"])
    # starved: the data waits, and the trainer's launch overhead in the gaps (host work)
    stalls = analysis.starved_ns - analysis.host_bound_ns
    assert _within(stalls, truth["data_wait_ns"]), (stalls, truth["data_wait_ns"])
    assert _within(analysis.cuda_steps["steps"], truth["step_count"])
    _reports_count_the_trainers_cuda_calls(whole, analysis, truth)


def _seconds_window(whole, lo: int, hi: int) -> Window:
    """The window [lo, hi) (monotonic ns) in seconds from the start of the trace `whole` covers."""
    return Window((lo - whole.span.start_ns) / 1e9, (hi - whole.span.start_ns) / 1e9)


def _reports_count_the_trainers_cuda_calls(whole, analysis, truth) -> None:
    """Every report carries it: the JSON `cuda` section, the text line, the HTML and
    Perfetto tracks count the trainer's launches and waits exactly (`whole`: the trace's
    analysis, `analysis`: its steps' window)."""
    from cuda_workloads import plan
    from report_contract import validate_report
    from trainbpf.reports.document import Report
    from trainbpf.reports.html import render_html
    from trainbpf.reports.perfetto import CUDA_TID_BASE, trace_events
    from trainbpf.reports.text import render_text

    trainer = truth["trainer"]
    report = Report.of(whole)
    validate_report(report.doc)
    kernels, count = sum(k for _, _, k in plan(11, truth["step_count"])), truth["step_count"]
    row = next(t for t in report.doc["cuda"]["threads"] if t["tid"] == trainer)
    assert (row["comm"], row["launches"], row["waits"]) == ("tb_trainer", kernels, count), row
    assert _within(row["wait_s"] * 1e9, truth["sync_ns"]) and report.doc["cuda"]["steps"]["count"] >= count - 2
    first_wait = truth["data_waits"][0][1] - truth["data_waits"][0][0]
    in_gaps = sum(f["launch_gap_s"] for f in Report.of(analysis).doc["findings"]) * 1e9
    print(f"reports: trainer launches {row['launches']}, waits {row['waits']}, wait s {row['wait_s']:.3f}; launch gap "
          f"s the findings explain {in_gaps / 1e9:.3f} (data waits after the first: "
          f"{(truth['data_wait_ns'] - first_wait) / 1e9:.3f})")
    assert _within(in_gaps, truth["data_wait_ns"] - first_wait), (in_gaps, truth["data_wait_ns"])
    assert f"CUDA tb_trainer ({trainer}): {kernels} launches, {count} GPU waits" in render_text(report)
    assert f'<g class="cuda-track" data-tid="{trainer}">' in render_html(report)
    events = json.loads("[" + ",".join(trace_events(whole)) + "]")
    track = CUDA_TID_BASE + 2 * [t["tid"] for t in report.doc["cuda"]["threads"]].index(trainer)
    mine = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] in (track, track + 1)]
    assert sum(e["cat"] == "cuda_wait" for e in mine) == count
    assert sum(e["args"]["launches"] for e in mine if e["cat"] == "cuda_launch") == kernels
