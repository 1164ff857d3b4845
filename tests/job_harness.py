"""Multi-process jobs for the tests: a real torchrun job of `scripts/workloads/ddp_job.py`
(gloo on the CPU), recorded through its launcher's pid and analysed, text and JSON."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scenario_harness import WORKLOADS, ScenarioError, fake_gpu_env, stop_process, trainbpf_cli
from scenario_machine import wait_for_quiet

from trainbpf.trace.spool import spool_path_for

# Workloads that run as a job under torchrun (tests/test_job.py), not on their own.
JOB_WORKLOADS = ("ddp_job",)
JOB_RECORD_SECONDS = 4
JOB_READY_TIMEOUT_S = 90
JOB_STEP_MS = 40


@dataclass
class JobRun:
    report: dict  # analyze --format json
    text: str  # analyze (the text report)
    trace: Path
    launcher_pid: int
    rank_pids: list[int]
    log: str  # the workload's stderr (torchrun's and the ranks')
    record_log: str  # trainbpf record's stderr


def torchrun() -> str:
    return str(Path(sys.executable).parent / "torchrun")


@contextlib.contextmanager
def running_job(workdir: Path, ranks: int, args: tuple[str, ...], env: dict | None = None, *,
                launch: tuple[str, ...] = ("--standalone",), prefix: tuple[str, ...] = ()):
    """torchrun with `ranks` ranks of ddp_job.py (`launch`: its rendezvous options;
    `prefix`: a command it runs under, exec'ing it), held until the recorder's spool
    exists (--hold-until); yields (launcher process, rank pids) once every rank is ready."""
    with started_job(workdir, ranks, args, env, launch=launch, prefix=prefix) as proc:
        yield proc, _ready_pids(proc, ranks, workdir)


@contextlib.contextmanager
def started_job(workdir: Path, ranks: int, args: tuple[str, ...], env: dict | None = None, *,
                launch: tuple[str, ...] = ("--standalone",), prefix: tuple[str, ...] = ()):
    """running_job's launcher, yielded as soon as it started; stopped at the end."""
    log = open(workdir / "job.log", "wb")
    proc = subprocess.Popen(
        [*prefix, torchrun(), *launch, f"--nproc_per_node={ranks}", str(WORKLOADS / "ddp_job.py"), *args],
        env={**(env or os.environ), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=log,
        cwd=workdir, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process(proc)
        log.close()


def _ready_pids(proc: subprocess.Popen, ranks: int, workdir: Path) -> list[int]:
    """The ranks' pids from their `ready pid=N` lines (written at once by several
    processes: read as a stream, not line by line)."""
    out = b""
    deadline = time.monotonic() + JOB_READY_TIMEOUT_S
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(pids := [int(p) for p in re.findall(rb"ready pid=(\d+)(?=\D)", out)]) < ranks:
            if time.monotonic() > deadline or not sel.select(max(0.1, deadline - time.monotonic())):
                raise ScenarioError(f"the torchrun job did not start ({out!r}); log: "
                                    f"{(workdir / 'job.log').read_text(errors='replace')[-2000:]}")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise ScenarioError(f"the torchrun job exited: {(workdir / 'job.log').read_text(errors='replace')[-2000:]}")
            out += chunk
    return pids


def record_job(workdir: Path, *, ranks: int = 3, slow: str = "input", slow_rank: int = 1,
               seconds: float = JOB_RECORD_SECONDS, target_rank: int | None = None) -> JobRun:
    """Record a torchrun job through its launcher's pid (or, with `target_rank`, that
    rank's alone) for `seconds` and analyse it."""
    cli = trainbpf_cli()
    trace = workdir / f"job-{slow}.parquet"
    go = spool_path_for(trace)  # the probes are compiled once the spool exists
    args = ("--seconds", "300", "--step-ms", str(JOB_STEP_MS), "--slow", slow, "--slow-rank", str(slow_rank),
            "--hold-until", str(go))
    # One simulated GPU per rank, sampled by the stand-in nvidia-smi.
    env = {**fake_gpu_env(workdir), "TRAINBPF_SIM_GPU_COUNT": str(ranks)}
    wait_for_quiet()
    with running_job(workdir, ranks, args, env) as (launcher, pids):
        target = launcher.pid if target_rank is None else _rank_pid(pids, target_rank)
        rec = subprocess.run([str(cli), "record", "--pid", str(target), "-o", str(trace), "--gpu", "nvidia-smi",
                              "--duration", str(seconds)], env=env, capture_output=True, text=True,
                             timeout=seconds + 120)
        if rec.returncode != 0:
            raise ScenarioError(f"trainbpf record exited {rec.returncode}: {rec.stderr[-2000:]}")
        if launcher.poll() is not None:
            raise ScenarioError(f"the job exited during the recording: "
                                f"{(workdir / 'job.log').read_text(errors='replace')[-2000:]}")
        launcher_pid = launcher.pid
    text = subprocess.run([str(cli), "analyze", str(trace)], capture_output=True, text=True, timeout=120)
    js = subprocess.run([str(cli), "analyze", str(trace), "--format", "json"], capture_output=True, text=True,
                        timeout=120)
    if text.returncode or js.returncode:
        raise ScenarioError(f"trainbpf analyze failed: {text.stderr[-1000:]} {js.stderr[-1000:]}")
    return JobRun(report=json.loads(js.stdout), text=text.stdout, trace=trace, launcher_pid=launcher_pid,
                  rank_pids=pids, log=(workdir / "job.log").read_text(errors="replace"), record_log=rec.stderr)


def _rank_pid(pids: list[int], rank: int) -> int:
    """The pid of rank `rank`: torchrun starts local ranks in order, so the ascending
    pids are ranks 0, 1, ... (checked against the rank's own environment)."""
    pid = sorted(pids)[rank]
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    if f"RANK={rank}".encode() not in env:
        raise ScenarioError(f"pid {pid} is not rank {rank}")
    return pid


# The two fake nodes' torchrun rendezvous: static, at node 0's address (inside the
# namespaces: the port is theirs alone).
TWO_NODE_PORT = 29500
# How late the slow rank is across two nodes, in steps: gloo's traffic through the veth
# pairs, four ranks and two recorders on two CPUs, makes the collectives' own
# communication up to a fifth of the waits; at 0.75 steps one CI run in four ranked it
# above the late rank's decoding.
TWO_NODE_SLOW_STEPS = 1.5


def record_two_nodes(workdir: Path, *, slow_rank: int, seconds: float = JOB_RECORD_SECONDS) -> list[Path]:
    """A job of 4 ranks as two nodes of 2 on this machine, each node a torchrun in a
    network namespace of its own (netns_env.two_nodes), recorded by a recorder of its
    own through its launcher's pid (recorders in this namespace: pids are global); the
    two traces."""
    from netns_env import two_nodes

    traces = [workdir / f"node{i}.parquet" for i in range(2)]
    envs = []
    for i in range(2):
        (workdir / f"node{i}").mkdir(exist_ok=True)
        envs.append({**fake_gpu_env(workdir / f"node{i}"), "TRAINBPF_SIM_GPU_COUNT": "2"})
    wait_for_quiet()
    with two_nodes() as nodes, contextlib.ExitStack() as stack:
        launchers = []
        for i, node in enumerate(nodes):
            args = ("--seconds", "300", "--step-ms", str(JOB_STEP_MS), "--slow", "input", "--slow-rank", str(slow_rank),
                    "--slow-steps", str(TWO_NODE_SLOW_STEPS), "--hold-until", str(spool_path_for(traces[i])))
            launch = ("--nnodes=2", f"--node_rank={i}", f"--master_addr={nodes[0].address}", f"--master_port={TWO_NODE_PORT}")
            launchers.append(stack.enter_context(started_job(
                workdir / f"node{i}", 2, args, {**envs[i], "GLOO_SOCKET_IFNAME": node.ifname}, launch=launch,
                prefix=tuple(node.enter()))))
        for i, launcher in enumerate(launchers):  # every rank joins the one world before any is ready
            _ready_pids(launcher, 2, workdir / f"node{i}")
        recorders = [subprocess.Popen([str(trainbpf_cli()), "record", "--pid", str(launcher.pid), "-o", str(trace),
                                       "--gpu", "nvidia-smi", "--duration", str(seconds)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for launcher, trace, env in zip(launchers, traces, envs)]
        for rec in recorders:
            stack.callback(stop_process, rec)
        for rec in recorders:
            _, err = rec.communicate(timeout=seconds + 120)
            if rec.returncode != 0:
                raise ScenarioError(f"trainbpf record exited {rec.returncode}: {err[-2000:]}")
        if any(launcher.poll() is not None for launcher in launchers):
            raise ScenarioError("a node's job exited during the recording: " + " ".join(
                (workdir / f"node{i}" / "job.log").read_text(errors="replace")[-1500:] for i in range(2)))
    return traces
