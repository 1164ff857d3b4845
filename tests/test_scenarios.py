"""Ground truth end to end (docs/scenarios.md): each workload injects one known bottleneck; the
real recorder and analyzer must name it as the top finding with a plausible share, and
must find nothing critical in the healthy run.

Needs root (BPF).  Without root these tests skip, except under CI=true, where they
fail: a set-up that cannot record must never pass as green.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from trainbpf.trace.reader import read_trace

from kernel_env import require_module
from scenario_harness import (
    GPU_SOURCES,
    REPORT_SCHEMA,
    SCENARIOS,
    Scenario,
    run_scenario,
    trainbpf_cli,
)
from scenario_machine import VM_SYSCTL, lowered_dirty_limits, memory_cgroup

MiB = 1 << 20
# A 6 s recording: nvidia-smi samples every 100 ms, NVML's driver every 167 ms.
MIN_GPU_SAMPLES = {"nvidia-smi": 30, "nvml": 20}
# The injected runs starve the simulated GPU for about half the time; the healthy one
# keeps it busy.
MIN_INJECTED_IDLE_FRACTION = 0.2
MAX_HEALTHY_IDLE_FRACTION = 0.1
# At step scale the GPU is partly busy in (nearly) every sample: what makes a model that
# counts only idle samples blind.
MIN_PARTLY_BUSY_SAMPLES = 0.8


def partly_busy_share(trace: Path) -> float:
    """The share of the device's GPU samples with utilisation strictly between 0 and 100,
    from the first busy one on: the samples taken before the workload's go (it holds its
    load until the recorder is ready) are idle whatever the workload's step scale."""
    gpu = read_trace(trace).frame("gpu")
    util = gpu.loc[gpu["pid"].isna()].sort_values("ts_ns")["value"].to_numpy(dtype=float)
    busy = np.flatnonzero(util > 0)
    if not len(busy):
        return 0.0
    util = util[busy[0]:]
    return float(((util > 0) & (util < 100)).mean())


@pytest.fixture(scope="session")
def can_record() -> None:
    if os.geteuid() != 0:
        reason = "scenario tests record with BPF and need root"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI=true, so this is a failure, not a skip")
        pytest.skip(reason)
    cli = trainbpf_cli()
    if not cli.exists():
        pytest.fail(f"{cli} is missing: install the project into this interpreter's "
                    "environment (scripts/setup.sh)")


def _require(scenario: Scenario) -> None:
    # The test extra installs it (pyproject.toml): a skip under CI would hide a broken set-up.
    if scenario.requires:
        require_module(scenario.requires, scenario.name)


# Neighbours' CPU use during a run (outside the workload and the recorder) above which
# cpu_contention is an honest top finding for any scenario on this 2-CPU machine.
BUSY_NEIGHBOURS_CORES = 0.5
BUSY_MIN_SECOND_SHARE = 0.2


def _named(top: dict, scenario: Scenario) -> str:
    """What the top finding blames first: the role of its first thread, and the first
    function of the trainer's own host work."""
    evidence = top["evidence"].get("trainer_loading") or top["evidence"]
    functions = evidence.get("functions") or [{"function": ""}]
    return f"{top['threads'][0]['role'] if top['threads'] else None} {functions[0]['function']}"


@pytest.mark.scenario
@pytest.mark.parametrize(("scenario", "gpu_source"),
                         [(s, g) for s in SCENARIOS if not s.healthy for g in GPU_SOURCES if g in s.gpu_sources],
                         ids=lambda v: v.id if isinstance(v, Scenario) else v)
def test_injected_bottleneck_is_the_top_finding(scenario: Scenario, gpu_source: str, can_record, tmp_path: Path):
    _require(scenario)
    result = run_scenario(scenario, tmp_path, gpu_source)
    report = result.report
    print(result.describe())
    assert report["schema"] == REPORT_SCHEMA
    assert report["gpu"]["source"] == gpu_source, result.describe()
    assert report["gpu"]["samples"] >= MIN_GPU_SAMPLES[gpu_source], result.describe()
    if scenario.step_ms is None:
        partly = partly_busy_share(result.trace)
        assert partly >= MIN_PARTLY_BUSY_SAMPLES, f"{partly:.2f} of samples partly busy: {result.describe()}"
    starved_fraction = report["starved_s"] / report["trace"]["duration_s"]
    assert starved_fraction >= scenario.min_starved_fraction, result.describe()
    # The trainer process drives the (simulated) GPU: nvidia-smi lists it as a compute app.
    meta = read_trace(result.trace).meta
    assert [p["pid"] for p in meta["gpu"]["processes"]] == [meta["target_pid"]], meta["gpu"]
    assert report["gpu"]["idle_fraction"] >= MIN_INJECTED_IDLE_FRACTION, (
        f"the workload did not starve the GPU: {result.describe()}")
    shares = [f["share"] for f in result.findings]
    assert shares == sorted(shares, reverse=True), result.describe()
    assert sum(shares) <= 1.0 + 1e-6, result.describe()
    top = result.top
    assert top is not None, result.describe()
    if (top["category"] == "cpu_contention" and "cpu_contention" not in scenario.expected
            and result.neighbour_cores >= BUSY_NEIGHBOURS_CORES):
        # Other work really did queue the workload's threads on the two CPUs: CPU
        # contention is then a true answer, and the injected cause must come right after.
        second = result.findings[1] if len(result.findings) > 1 else {"category": None, "share": 0.0}
        assert second["category"] in scenario.expected, result.describe()
        assert second["share"] >= BUSY_MIN_SECOND_SHARE, result.describe()
        return
    assert top["category"] in scenario.expected, result.describe()
    assert scenario.min_share <= top["share"] <= 1.0, result.describe()
    assert top["severity"] == "critical", result.describe()
    assert top["culprits"], result.describe()
    if top["category"] in ("lock_contention", "gil_contention"):
        # The lock (its address, named where it could be) and its holders: the threads
        # whose release ended the trainer's waits.
        holders = [c for c in top["culprits"] if c.get("holder")]
        assert holders and all(c["tid"] != meta["target_pid"] for c in holders), top["culprits"]
        assert [c for c in top["culprits"] if c["kind"] == "lock"], top["culprits"]
    if scenario.culprit:
        _names_the_culprit(top, scenario, result)
    if scenario.peer or scenario.uploader:
        _names_the_network_culprit(top, scenario, result)
    if scenario.refault:  # a disk finding says what was read again, and what pushed it out
        file, comm = scenario.refault
        again = [f for f in result.findings if (f["evidence"].get("io") or {}).get("refaulted")]
        assert again, result.describe()
        assert [c for c in again[0]["culprits"] if c.get("refaulted_bytes") and c["name"].endswith("/" + file)]
        assert f"/{file} after the page cache dropped it for" in again[0]["summary"], again[0]["summary"]
        assert comm in again[0]["summary"] and comm in again[0]["recommendation"], again[0]
    role, function = _named(top, scenario).split(" ", 1)
    if scenario.producer is not None:
        assert role == scenario.producer, (top["threads"], result.describe())
    if scenario.function is not None:
        assert function.rsplit(".", 1)[-1] == scenario.function, (top["evidence"], result.describe())


def test_every_gpu_source_runs_several_scenarios():
    """Each scenario runs under one GPU source: both sources must still carry several."""
    runs = [g for s in SCENARIOS for g in s.gpu_sources]
    assert min(runs.count(g) for g in GPU_SOURCES) >= 5, runs


@pytest.mark.scenario
@pytest.mark.parametrize("gpu_source", next(s for s in SCENARIOS if s.healthy).gpu_sources)
def test_healthy_run_has_no_critical_finding(gpu_source: str, can_record, tmp_path: Path):
    healthy = next(s for s in SCENARIOS if s.healthy)
    result = run_scenario(healthy, tmp_path, gpu_source)
    print(result.describe())
    report = result.report
    assert report["schema"] == REPORT_SCHEMA
    assert report["gpu"]["samples"] >= MIN_GPU_SAMPLES[gpu_source], result.describe()
    assert report["gpu"]["idle_fraction"] <= MAX_HEALTHY_IDLE_FRACTION, result.describe()
    critical = [f for f in result.findings if f["severity"] == "critical"]
    assert not critical, result.describe()


# The harness's own promises: what it bends is put back even when the body fails.

DIRTY_KNOBS = ("dirty_bytes", "dirty_ratio", "dirty_background_bytes", "dirty_background_ratio")


def _dirty_knobs() -> dict[str, str]:
    return {k: (VM_SYSCTL / k).read_text().strip() for k in DIRTY_KNOBS}


@pytest.mark.scenario
def test_dirty_limits_are_restored_after_a_failure(can_record):
    before = _dirty_knobs()
    with pytest.raises(RuntimeError, match="boom"):
        with lowered_dirty_limits(16 * MiB, 4 * MiB):
            during = _dirty_knobs()
            raise RuntimeError("boom")
    assert during["dirty_bytes"] == str(16 * MiB)
    assert during["dirty_background_bytes"] == str(4 * MiB)
    assert _dirty_knobs() == before


@pytest.mark.scenario
def test_memory_cgroup_is_removed_after_a_failure(can_record):
    with pytest.raises(RuntimeError, match="boom"):
        with memory_cgroup(256 * MiB) as cgroup:
            path = cgroup.path
            limit_file = "memory.limit_in_bytes" if cgroup.version == 1 else "memory.max"
            assert int((path / limit_file).read_text()) == 256 * MiB
            raise RuntimeError("boom")
    assert not path.exists()


def _names_the_culprit(top: dict, scenario: Scenario, result) -> None:
    """A disk finding names the file that filled the disk and the thread that wrote it,
    and its advice is about that writer (with O_DIRECT already: the device's limit)."""
    file, comm = scenario.culprit
    files = [c for c in top["culprits"] if c["kind"] == "file"]
    if top["category"] == "memory_reclaim":  # the cgroup, and the files that filled it
        assert top["evidence"]["case"] == "page_cache", (top["summary"], result.describe())
        assert [c for c in top["culprits"] if c["kind"] == "cgroup" and c["limit_bytes"] == scenario.memory_limit]
        assert files and file in files[0]["name"] and comm in top["summary"], (top["summary"], top["culprits"])
        return
    direct = "--direct-checkpoint" in scenario.variant
    writers = [c for c in top["culprits"] if c["kind"] in ("thread", "process") and c["name"] == comm]
    assert writers, (top["culprits"], result.describe())
    assert comm in top["recommendation"], (top["recommendation"], result.describe())
    if direct:
        assert not [c for c in files if c["name"].endswith("/" + file)], "O_DIRECT: no writeback of the checkpoint"
        assert top["evidence"]["case"] == "direct_writes", (top["summary"], result.describe())
        assert file in top["summary"] and "already writes" in top["recommendation"], top
    else:
        assert files and files[0]["name"].endswith("/" + file), (top["culprits"], result.describe())
        assert files[0]["write_paths"] == ["buffered"], top["culprits"]
        assert top["evidence"]["case"] == "writeback" and "O_DIRECT" in top["recommendation"], top


def _names_the_network_culprit(top: dict, scenario: Scenario, result) -> None:
    """A network finding names the store it waited on, or the upload that shared its link
    (with its bytes and rate), and its advice is about that."""
    if scenario.peer:
        peers = [c for c in top["culprits"] if c["kind"] == "peer"]
        assert peers and peers[0]["name"] == scenario.peer, (top["culprits"], result.describe())
        assert peers[0]["requests"] > 0 and peers[0]["recv_bytes"] > 0, peers[0]
        assert scenario.peer in top["summary"], top["summary"]
    if scenario.uploader:
        uploads = [c for c in top["culprits"] if c.get("uploader")]
        assert uploads and uploads[0]["name"] == scenario.uploader, (top["culprits"], result.describe())
        assert uploads[0]["bytes"] > 0 and uploads[0]["rate_bytes_per_s"] > 0, uploads[0]
        assert top["evidence"]["case"] == "upload", (top["summary"], result.describe())
        assert top["recommendation"].startswith(scenario.uploader), top["recommendation"]
