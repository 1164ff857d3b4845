"""Training-step metrics in `trainbpf health` and `trainbpf fleet`, from the CUDA calls:
step time p50/p99, steps/s and host-bound share per target when its trainer's CUDA calls
were traced, "not traced" (never zeros) when they were not, and no effect on the status."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_env import require_root
from synth import TRAINER, WORKER, d, healthy, t
from test_health_kernel import run_health, write_config
from test_health_outputs import parse_exposition, sample_result
from trainbpf.fleet import fleet_rows, load_documents, render
from trainbpf.health.config import DEFAULT_THRESHOLDS, OK, HealthConfig
from trainbpf.health.outputs import STEP_METRICS, health_document, render_summary, render_textfile
from trainbpf.health.results import StepMetrics, TargetResult, grade_report, step_metrics
from trainbpf.health.run import assess
from trainbpf.health.targets import Target

STEP_S, HOST_S, WAIT_S = 0.05, 0.02, 0.03
TRACED = StepMetrics(True, 40, 19.5, 0.05, 0.081, 0.4)
ROOT = Path(__file__).resolve().parents[1]

# A trainer on the stand-in CUDA runtime: 10 ms of host work (a sleep), one kernel of
# 10 ms of simulated GPU time, a stream synchronisation; prints a line once loaded.
CUDA_TRAINER = """
import ctypes, sys, time
sys.path.insert(0, sys.argv[3])
from kernel_workloads import Dim3
rt, drv = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(sys.argv[2])
drv.fakecuda_set_kernel_ns(ctypes.c_uint64(10_000_000))
one, stream = Dim3(1, 1, 1), ctypes.c_void_p(0x77)
print(flush=True)
while True:
    time.sleep(0.01)
    rt.cudaLaunchKernel(None, one, one, None, ctypes.c_size_t(0), stream)
    rt.cudaStreamSynchronize(stream)
"""


def cuda_trainer(duration_s: float = 10.0):
    """healthy(), with the trainer in a CUDA rhythm: every 50 ms a burst of launches
    20 ms after the previous synchronisation ended, then a 30 ms synchronisation."""
    s = healthy(duration_s)
    s.meta["probes"] = [*s.meta["probes"], "cuda"]
    x = 0.01
    while x + STEP_S < duration_s - 0.01:
        s.add("cuda_launch", ts_ns=t(x + HOST_S), dur_ns=d(0.0001), tid=TRAINER, pid=TRAINER, name="runtime", op=0, count=4)
        s.add("cuda_call", ts_ns=t(x + HOST_S + 0.0001), dur_ns=d(WAIT_S - 0.0001), tid=TRAINER, pid=TRAINER,
              name="cudaStreamSynchronize", state="wait", op=0, addr=0x51, size=0, count=0, ustack_id=None)
        x += STEP_S
    return s


def _assess(tmp_path, synth):
    path = synth.write(tmp_path / "trace.parquet")
    target = Target(TRAINER, "python", "python train.py", "pid")
    return assess(trace_path=path, targets=[target], trees={TRAINER: ({TRAINER, WORKER}, {TRAINER, WORKER})},
                  config=HealthConfig(), started=0.0, host="synth")


def test_steps_of_a_traced_trainer_through_the_analysis(tmp_path):
    result = _assess(tmp_path, cuda_trainer())
    steps = result.targets[0].steps
    assert steps.traced and steps.steps >= 150, steps
    assert steps.step_p50_s == pytest.approx(STEP_S, rel=0.01) and steps.step_p99_s == pytest.approx(STEP_S, rel=0.01)
    assert steps.steps_per_s == pytest.approx(1 / STEP_S, rel=0.01)
    assert steps.host_bound_share == pytest.approx(HOST_S / STEP_S, rel=0.02)
    text = render_textfile(result)
    values = parse_exposition(text)
    assert values[("trainbpf_target_cuda_traced", (("pid", "100"),))] == 1
    assert values[("trainbpf_target_step_p50_seconds", (("pid", "100"),))] == pytest.approx(STEP_S, rel=0.01)
    assert values[("trainbpf_target_host_bound_ratio", (("pid", "100"),))] == pytest.approx(0.4, rel=0.02)
    doc = health_document(result)
    assert doc["steps"] == doc["targets"][0]["steps"] and doc["steps"]["traced"] is True
    assert "step 50 ms p50, 50 ms p99, 20 steps/s, 40% host-bound" in render_summary(result)


def test_faults_per_step_of_a_traced_trainer(tmp_path):
    s = cuda_trainer()
    steps = 0
    x = 0.01
    while x + STEP_S < 10.0 - 0.01:  # 512 faults (2 MiB of 4 KiB pages) a step, read every step
        s.add("faults", ts_ns=t(x), dur_ns=d(STEP_S), tid=WORKER, pid=TRAINER, count=512)
        x += STEP_S
        steps += 1
    result = _assess(tmp_path, s)
    got = result.targets[0].steps
    assert got.faults_per_step == pytest.approx(512 * steps / got.steps, rel=0.02), got
    values = parse_exposition(render_textfile(result))
    assert values[("trainbpf_target_faults_per_step", (("pid", "100"),))] == pytest.approx(got.faults_per_step)
    assert health_document(result)["steps"]["faults_per_step"] == pytest.approx(got.faults_per_step)


def test_untraced_trainer_says_so_and_writes_no_step_values(tmp_path):
    result = _assess(tmp_path, healthy())
    assert result.targets[0].steps == StepMetrics(False)
    values = parse_exposition(render_textfile(result))
    assert values[("trainbpf_target_cuda_traced", (("pid", "100"),))] == 0
    assert not [k for k in values if k[0] in STEP_METRICS.values()]
    doc = health_document(result)
    assert doc["targets"][0]["steps"] == {"traced": False, "steps": None, "steps_per_s": None, "step_p50_s": None,
                                          "step_p99_s": None, "host_bound_share": None, "faults_per_step": None}
    assert "CUDA not traced" in render_summary(result)


def test_step_metrics_from_an_analysis_summary():
    assert step_metrics(False, {"steps": 3, "step_p50_s": 0.1}) == StepMetrics(False)
    assert step_metrics(True, None) == StepMetrics(True, steps=0)  # traced, no complete step
    got = step_metrics(True, {"steps": 2, "steps_per_s": 5.0, "step_p50_s": 0.2, "step_p99_s": math.nan,
                              "host_bound_share": 0.25, "worst": []})
    assert got == StepMetrics(True, 2, 5.0, 0.2, None, 0.25)  # never a NaN


def test_traced_without_a_complete_step_writes_only_the_count():
    result = sample_result()
    result.targets[0].steps = StepMetrics(True, steps=0)
    values = parse_exposition(render_textfile(result))
    assert values[("trainbpf_target_steps", (("pid", "4242"),))] == 0
    assert ("trainbpf_target_steps_per_second", (("pid", "4242"),)) not in values
    assert "CUDA traced, no complete step" in render_summary(result)


def test_target_not_analysed_has_no_cuda_values():
    result = sample_result()
    result.targets = [TargetResult(Target(7, "python", "x", "pid"), error="pid 7: analysis failed")]
    values = parse_exposition(render_textfile(result))
    assert not [k for k in values if k[0] == "trainbpf_target_cuda_traced" or k[0] in STEP_METRICS.values()]
    doc = health_document(result)
    assert doc["targets"][0]["steps"]["traced"] is None and doc["steps"]["traced"] is None
    json.dumps(doc, allow_nan=False)


@pytest.mark.parametrize("host_bound", [0.02, 0.98])
def test_host_bound_share_does_not_grade(host_bound):
    """Only the starved ratio grades a target: a host-bound trainer whose GPU did not
    idle is healthy (the findings say why time was lost, not the share)."""
    report = {"trace": {"duration_s": 10.0}, "starved_s": 0.5, "host_bound_s": 0.0, "gpu": {"idle_fraction": 0.05}, "findings": [],
              "threads": []}
    steps = StepMetrics(True, 100, 10.0, 0.1, 0.2, host_bound)
    graded = grade_report(Target(1, "python", "x", "pid"), report, tids={1}, thresholds=DEFAULT_THRESHOLDS, steps=steps)
    assert graded.status == OK and graded.steps == steps


def _fleet_doc(host: str, starved: float | None, steps: dict | None) -> dict:
    doc = {"schema": "trainbpf.health/1", "host": host, "status": "ok", "exit_code": 0, "error": None,
           "finished": "2027-01-15T08:00:00Z", "finished_timestamp": 1.0, "starved_ratio": starved,
           "top_category": None, "targets": []}
    if steps is not None:
        doc["steps"] = steps
    return doc


def test_fleet_rows_carry_step_metrics(tmp_path):
    traced = {**TRACED.as_dict()}
    untraced = StepMetrics(False).as_dict()
    files = []
    for host, starved, steps in (("n-traced", 0.3, traced), ("n-untraced", 0.2, untraced), ("n-old", 0.1, None)):
        files.append(tmp_path / f"{host}.json")
        files[-1].write_text(json.dumps(_fleet_doc(host, starved, steps)))
    docs, skipped = load_documents(files)
    assert not skipped
    rows = {r.host: r for r in fleet_rows(docs)}
    assert rows["n-traced"].cuda_traced is True and rows["n-traced"].step_p99_s == 0.081
    assert rows["n-traced"].host_bound_share == 0.4 and rows["n-traced"].steps_per_s == 19.5
    assert rows["n-untraced"].cuda_traced is False and rows["n-untraced"].step_p50_s is None
    assert rows["n-old"].cuda_traced is None  # a document from before step metrics
    lines = {ln.split()[1]: ln for ln in render(list(rows.values()), "text").splitlines()[1:] if ln.strip()}
    assert "50/81 ms" in lines["n-traced"] and "19.5" in lines["n-traced"] and "40.0%" in lines["n-traced"]
    assert "not traced" in lines["n-untraced"] and "not traced" not in lines["n-old"]
    nodes = {n["host"]: n for n in json.loads(render(list(rows.values()), "json"))["nodes"]}
    assert nodes["n-untraced"]["step_p50_s"] is None and nodes["n-traced"]["host_bound_share"] == 0.4
    assert "host_bound_share" in render(list(rows.values()), "csv").splitlines()[0]


@pytest.mark.parametrize("steps", ["fast", {"traced": "yes"}, {"traced": True, "step_p50_s": "1"}])
def test_fleet_skips_malformed_step_metrics(tmp_path, steps):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_fleet_doc("n", 0.1, steps)))
    docs, skipped = load_documents([path])
    assert not docs and len(skipped) == 1 and "steps" in skipped[0]


@pytest.mark.kernel
def test_health_run_reports_the_steps_of_a_real_cuda_trainer(tmp_path):
    """`trainbpf health` on two given pids: a trainer calling the stand-in CUDA runtime
    (its steps: ~20 ms, half host-bound) and a plain sleeper (not traced)."""
    require_root()
    spec = importlib.util.spec_from_file_location("fake_cuda_build", ROOT / "scripts" / "fake-cuda" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    runtime = build.build(tmp_path / "wheel")
    driver = tmp_path / "wheel" / build.DRIVER
    trainer = subprocess.Popen([sys.executable, "-c", CUDA_TRAINER, str(runtime), str(driver), str(ROOT / "tests")],
                               stdout=subprocess.PIPE)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert trainer.stdout.readline() == b"\n"
        config = write_config(tmp_path)
        run = run_health(tmp_path, "--duration", "3", "--config", str(config),
                         "--pid", str(trainer.pid), "--pid", str(sleeper.pid))
    finally:
        for proc in (trainer, sleeper):
            proc.kill()
            proc.wait()
    assert run.proc.returncode in (0, 1, 2), run.proc.stderr
    by_pid = {t["pid"]: t["steps"] for t in run.doc["targets"]}
    steps = by_pid[trainer.pid]
    assert steps["traced"] is True and steps["steps"] >= 30, steps
    assert 0.018 <= steps["step_p50_s"] <= 0.04 and steps["step_p99_s"] >= steps["step_p50_s"], steps
    assert 0.25 <= steps["host_bound_share"] <= 0.75 and 25 <= steps["steps_per_s"] <= 55, steps
    assert by_pid[sleeper.pid] == StepMetrics(False).as_dict()
    samples = run.samples
    assert samples[("trainbpf_target_cuda_traced", (("pid", str(trainer.pid)),))] == 1
    assert samples[("trainbpf_target_step_p50_seconds", (("pid", str(trainer.pid)),))] == pytest.approx(steps["step_p50_s"])
    assert samples[("trainbpf_target_cuda_traced", (("pid", str(sleeper.pid)),))] == 0
    assert ("trainbpf_target_steps", (("pid", str(sleeper.pid)),)) not in samples
    assert "CUDA not traced" in run.proc.stdout and "host-bound" in run.proc.stdout, run.proc.stdout
