"""`trainbpf health` on workloads at step scale (issue: starvation with the GPU partly
busy in every sample): the fine-grained input-pipeline workload is critical and names
input_pipeline; the healthy one is ok.  Real recordings of the scenario workloads
behind the nvidia-smi stand-in."""

from __future__ import annotations

import pytest

from kernel_env import require_root
from scenario_harness import SCENARIOS, fake_gpu_env, running_workload
from scenario_machine import wait_for_quiet
from test_health_kernel import run_health, write_config

pytestmark = [pytest.mark.kernel, pytest.mark.scenario]

HEALTH_SECONDS = "5"


def _health_of(name: str, tmp_path):
    scenario = next(s for s in SCENARIOS if s.name == name and s.step_ms is None)
    env = fake_gpu_env(tmp_path)
    # starved_ratio at its defaults (warning 0.2, critical 0.4); node checks off.
    config = write_config(tmp_path, gpu="nvidia-smi", thresholds={})
    wait_for_quiet()
    with running_workload(scenario, env, tmp_path) as workload:
        run = run_health(tmp_path, "--pid", str(workload.pid), "--duration", HEALTH_SECONDS,
                         "--config", str(config), env=env)
    return workload.pid, run


def test_fine_grained_input_pipeline_is_critical(tmp_path):
    require_root()
    pid, run = _health_of("interleaved_steps", tmp_path)
    assert run.proc.returncode == 2, (run.proc.stdout, run.proc.stderr)
    [target] = run.doc["targets"]
    assert target["pid"] == pid and target["status"] == "critical", target
    assert target["starved_ratio"] >= 0.4, target
    assert target["findings"][0]["category"] == "input_pipeline", target["findings"]
    assert 0.15 < 1 - target["gpu_idle_fraction"] < 0.7  # partly busy in every sample, never near idle
    assert "input_pipeline" in run.proc.stdout


def test_healthy_workload_is_ok(tmp_path):
    require_root()
    pid, run = _health_of("healthy", tmp_path)
    assert run.proc.returncode == 0, (run.proc.stdout, run.proc.stderr)
    [target] = run.doc["targets"]
    assert target["pid"] == pid and target["status"] == "ok", target
    assert target["gpu_idle_fraction"] <= 0.1
