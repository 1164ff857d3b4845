"""The scenario workloads on their own (no recorder, no root): each starts, announces
itself, drives its simulated GPU, exits cleanly when its time is up or on SIGTERM,
and leaves no files behind."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job_harness import JOB_WORKLOADS
from scenario_harness import OWN_TEST_SCENARIOS, SCENARIOS, WORKLOADS

RUN_SECONDS = 2.0


def _workload_names() -> list[str]:
    return sorted(p.stem for p in WORKLOADS.glob("*.py") if p.stem != "common")


def _start(name: str, tmp_path: Path, seconds: float, *extra: str) -> subprocess.Popen:
    script = WORKLOADS / f"{name}.py"
    args = [sys.executable, str(script), "--seconds", str(seconds), *extra]
    if "add_dir_argument" in script.read_text():  # it writes files: keep them in view
        args += ["--dir", str(tmp_path / name)]
    env = {**os.environ, "TRAINBPF_SIM_GPU": str(tmp_path / f"{name}.sim")}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _runnable(name: str) -> bool:
    requires = {s.name: s.requires for s in SCENARIOS}.get(name)
    return not requires or importlib.util.find_spec(requires) is not None


def test_every_workload_is_a_scenario():
    assert sorted({s.name for s in SCENARIOS + OWN_TEST_SCENARIOS} | set(JOB_WORKLOADS)) == _workload_names()


def test_workloads_run_announce_and_drive_the_simulated_gpu(tmp_path: Path):
    names = [n for n in _workload_names() if _runnable(n) and n not in JOB_WORKLOADS]
    for name in names:
        (tmp_path / name).mkdir()
    # All at once: two cores, so each takes longer than alone, but the suite stays short.
    procs = {name: _start(name, tmp_path, RUN_SECONDS) for name in names}
    failures = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failures.append(f"{name}: exit {proc.returncode}: {err[-1000:]}")
            continue
        if out.splitlines() != [f"ready pid={proc.pid}"]:
            failures.append(f"{name}: stdout {out!r}")
        sim = tmp_path / f"{name}.sim"
        intervals = [tuple(map(int, line.split())) for line in sim.read_text().splitlines()]
        if not intervals or any(end <= start for start, end in intervals):
            failures.append(f"{name}: simulated GPU intervals {intervals[:3]}")
        if not re.search(r"\d+ steps, simulated GPU busy \d+%", err):
            failures.append(f"{name}: no summary line on stderr: {err[-500:]}")
        if any((tmp_path / name).iterdir()):
            failures.append(f"{name}: left files behind: {list((tmp_path / name).iterdir())}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["decode_processes", "checkpoint_dirty"])
def test_sigterm_ends_a_workload_and_its_helpers_cleanly(name: str, tmp_path: Path):
    (tmp_path / name).mkdir()
    proc = _start(name, tmp_path, 300)
    assert proc.stdout.readline().strip() == f"ready pid={proc.pid}"
    children = _children(proc.pid)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
    time.sleep(0.5)
    assert not [pid for pid in children if _alive(pid)]
    assert not any((tmp_path / name).iterdir())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_hold_until_creates_the_threads_but_holds_the_load(tmp_path: Path):
    go = tmp_path / "go"
    proc = _start("decode_threads", tmp_path, 1.0, "--hold-until", str(go))
    try:
        assert proc.stdout.readline().strip() == f"ready pid={proc.pid}"
        assert len(list(Path(f"/proc/{proc.pid}/task").iterdir())) >= 3  # trainer + workers
        time.sleep(1.0)
        sim = tmp_path / "decode_threads.sim"
        assert not sim.exists() or sim.read_text() == ""  # no GPU step yet
        cpu_before = _process_cpu_s(proc.pid)
        time.sleep(0.5)
        assert _process_cpu_s(proc.pid) - cpu_before < 0.1  # no decoding either
        go.touch()
        proc.wait(timeout=60)
        assert proc.returncode == 0
        assert sim.read_text().strip()
    finally:
        proc.kill()
        proc.wait()


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_numa_workload_writes_the_declared_topology(tmp_path: Path):
    topology = tmp_path / "topology.json"
    proc = _start("numa_wrong_node", tmp_path, 0.5, "--topology-out", str(topology))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    declared = json.loads(topology.read_text())
    assert declared == {"nodes": {"0": [0], "1": [1]}, "gpus": [{"index": 0, "node": 0}]}
