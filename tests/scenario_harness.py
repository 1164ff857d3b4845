"""Ground-truth scenarios (docs/scenarios.md): run a workload with one injected bottleneck under
the real recorder CLI, analyse the trace with the real analyzer CLI, and hand back the
JSON report for the test to judge.

Each workload (scripts/workloads/<name>.py) drives a simulated GPU that the nvidia-smi
stand-in (scripts/fake-nvidia-smi) samples; the harness puts the stand-in first on PATH
for the recorder (fake_nvml_env: the stand-in NVML library, scripts/fake-nvml, first on
LD_LIBRARY_PATH instead).  Some scenarios need the machine bent for the run: lower
dirty-page limits, a memory-limited cgroup.  Every such change is undone on the way out,
whatever happens in between.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kernel_env import stop_process
from netns_env import STORE_ADDRESS, STORE_PORT, store_namespace, store_server
from scenario_machine import MemoryCgroup, NeighbourMeter, ScenarioError, lowered_dirty_limits, memory_cgroup, wait_for_quiet
from trainbpf.trace.spool import spool_path_for

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "scripts" / "workloads"
FAKE_SMI = ROOT / "scripts" / "fake-nvidia-smi"
FAKE_NVML_BUILD = ROOT / "scripts" / "fake-nvml" / "build.py"
REPORT_SCHEMA = "trainbpf.report/3"

RECORD_SECONDS = 6
# The workload outlives any recording; it is stopped once the recorder is done.
WORKLOAD_SECONDS = 300
READY_TIMEOUT_S = 60
# bcc compiles the probes when the recorder starts.  The workload holds its load until
# the recorder's spool file appears (--hold-until), so the compile has the machine to
# itself: with 8 busy threads beside it, it took a minute.
RECORD_TIMEOUT_S = RECORD_SECONDS + 120
ANALYZE_TIMEOUT_S = 120

MiB = 1 << 20


@dataclass(frozen=True)
class Scenario:
    name: str  # the workload: scripts/workloads/<name>.py
    # Categories accepted as the top finding; empty for the healthy run.
    expected: tuple[str, ...] = ()
    min_share: float = 0.3
    # (vm.dirty_bytes, vm.dirty_background_bytes) for the run.
    dirty_limits: tuple[int, int] | None = None
    memory_limit: int | None = None  # run inside a cgroup with this memory limit
    declares_topology: bool = False  # the workload writes the topology for --topology
    requires: str | None = None  # a module the workload imports beyond numpy
    step_ms: float | None = None  # the GPU step (None: the workloads' default, 40 ms)
    min_starved_fraction: float = 0.0  # starved seconds per recorded second, at least
    # Who the top finding names first: "trainer" (its own host work) or "dataloader".
    producer: str | None = None
    function: str | None = None  # the function its evidence names first (host work)
    # The GPU sampling it runs under: one each, to keep the suite short (the same
    # simulated GPU is behind both; the scenarios share the sources between them).
    gpu_sources: tuple[str, ...] = ("nvidia-smi",)
    variant: tuple[str, ...] = ()  # the workload's own arguments: another case of it
    # (file name, thread comm) the top finding's culprits name: what made the disk busy.
    culprit: tuple[str, str] | None = None
    # (file name, thread comm): a finding says the file was read again after the page
    # cache dropped it for a file that thread wrote.
    refault: tuple[str, str] | None = None
    record_seconds: float = RECORD_SECONDS  # a scenario tested on its own may record less
    probes: str | None = None  # the recorder's --probes (None: its default set)
    # A store in a network namespace of its own answering after this many ms (None: no
    # store), over a link shaped to `link_mbit` (None: not shaped); the workload gets --store.
    store_delay_ms: float | None = None
    link_mbit: float | None = None
    # What the top network finding names: its first peer, and the uploader's comm.
    peer: str | None = None
    uploader: str | None = None

    @property
    def healthy(self) -> bool:
        return not self.expected

    @property
    def id(self) -> str:
        name = self.name + "".join(a.replace("--", "+") for a in self.variant)
        return name if self.step_ms is None else f"{name}@{self.step_ms:g}ms"


# Each GPU sampling runs every kind of stall; a scenario runs under both where the two
# sample periods (100 ms, 167 ms) meet its stall differently, under one otherwise (the
# suite's time).  Every workload runs at step scale: GPU steps of 40 ms, an injected stall of about a
# step (shorter than one GPU sample), the GPU partly busy in every sample.
SCENARIOS = (
    # Issue 10's case: half of every 30-60 ms step waiting for the dataloader.
    Scenario("interleaved_steps", ("input_pipeline",), min_starved_fraction=0.4, gpu_sources=("nvidia-smi",)),
    Scenario("decode_threads", ("input_pipeline",), gpu_sources=("nvml",)),
    # The slow variant: 150 ms steps, stalls longer than a sample.
    Scenario("decode_threads", ("input_pipeline",), step_ms=150, gpu_sources=("nvidia-smi",)),
    Scenario("decode_processes", ("input_pipeline",), gpu_sources=("nvidia-smi",)),
    Scenario("decode_torch", ("input_pipeline",), requires="torch", producer="dataloader", gpu_sources=("nvidia-smi",)),
    # Issue 35: the trainer's own work on the CPU, the GPU idle meanwhile.
    Scenario("inproc_torch", ("input_pipeline",), requires="torch", producer="trainer", function="__getitem__",
             gpu_sources=("nvidia-smi",)),
    Scenario("inproc_decode", ("input_pipeline",), producer="trainer", function="decode_batch",
             gpu_sources=("nvml",)),
    Scenario("cpu_optimizer", ("host_compute",), producer="trainer", function="adam_step",
             gpu_sources=("nvidia-smi",)),
    Scenario("cpu_oversubscribed", ("cpu_contention",), gpu_sources=("nvml",)),
    # A real pthread mutex, not the GIL: gil_contention would be the wrong answer.
    Scenario("allocator_lock", ("lock_contention",), gpu_sources=("nvml",)),
    # The GIL, named by its address in _PyRuntime: lock_contention would be the wrong answer.
    Scenario("gil_threads", ("gil_contention",), gpu_sources=("nvml",)),
    Scenario("mmap_churn", ("allocator_churn", "page_faults"), gpu_sources=("nvidia-smi",)),
    Scenario("checkpoint_dirty", ("dirty_throttling",), dirty_limits=(2 * MiB, 1 * MiB), gpu_sources=("nvml",)),
    # Issue 29: the loader's O_DIRECT reads queue behind a checkpoint's writeback; the
    # culprit is the checkpoint and its writer, not the storage.  Then the checkpoint
    # written with O_DIRECT itself: no writeback, the writer's own requests.
    Scenario("checkpoint_loader", ("block_io",), dirty_limits=(64 * MiB, 16 * MiB),
             culprit=("checkpoint.bin", "ckpt_writer"), gpu_sources=("nvidia-smi",)),
    Scenario("checkpoint_loader", ("block_io",), variant=("--direct-checkpoint",),
             culprit=("checkpoint.bin", "ckpt_writer"), gpu_sources=("nvml",)),
    Scenario("reclaim_cgroup", ("memory_reclaim",), memory_limit=256 * MiB, gpu_sources=("nvidia-smi",),
             culprit=("shard", "shard_writer")),
    # The dataset's pages dropped for the checkpoints' and read again: the loader waits
    # for the disk, reclaims, and copies what the cache still holds (its own CPU time:
    # input_pipeline); whichever is largest, a disk finding must name the refault.
    Scenario("dataset_evicted", ("block_io", "memory_reclaim", "input_pipeline"), min_share=0.25,
             memory_limit=256 * MiB, probes="default,pagecache",
             refault=("dataset.bin", "ckpt_writer"), gpu_sources=("nvml",)),
    # Issue 30: the loader waits on a store 30 ms away; then an upload of the job's own
    # on the same link, shaped to 20 mbit, delays a store that answers in 5 ms.
    Scenario("slow_store", ("network_io",), store_delay_ms=30, peer=f"{STORE_ADDRESS}:{STORE_PORT}",
             gpu_sources=("nvidia-smi",)),
    Scenario("competing_upload", ("network_io",), store_delay_ms=5, link_mbit=20, uploader="ckpt_upload",
             gpu_sources=("nvml",)),
    Scenario("numa_wrong_node", ("numa_remote",), declares_topology=True, gpu_sources=("nvidia-smi",)),
    Scenario("demo_trainer", ("input_pipeline",), gpu_sources=("nvml",)),
    Scenario("healthy", gpu_sources=("nvml",)),
)
# Scenarios with a test of their own (their answer is not the top finding).  The lock is
# taken thousands of times a second: recorded for less than the suite's scenarios.
MALLOC_ARENA = Scenario("malloc_arena", ("lock_contention",), gpu_sources=("nvidia-smi",), record_seconds=4)
OWN_TEST_SCENARIOS = (MALLOC_ARENA,)
# The GPU sampling each scenario runs under (the same simulated GPU behind both).
GPU_SOURCES = ("nvidia-smi", "nvml")


@dataclass
class ScenarioResult:
    scenario: Scenario
    gpu_source: str
    report: dict
    trace: Path
    workdir: Path
    busy_cores_before: float  # CPU use on the machine just before the workload started
    # CPU use during the recording by everything but the workload and the recorder.
    neighbour_cores: float

    @property
    def findings(self) -> list[dict]:
        return self.report["findings"]

    @property
    def top(self) -> dict | None:
        return self.findings[0] if self.findings else None

    def describe(self) -> str:
        """One line for people: the GPU's idleness and the findings, biggest first."""
        gpu = self.report.get("gpu") or {}
        parts = [f"{f['category']} {f['share']:.2f} ({f['severity']}, {f['seconds']:.2f} s)"
                 for f in self.findings]
        return (f"{self.scenario.id} ({self.gpu_source}): GPU idle {gpu.get('idle_fraction')} over "
                f"{gpu.get('samples')} samples, starved {self.report.get('starved_s')} s; "
                f"findings: {'; '.join(parts) or 'none'} "
                f"[machine busy {self.busy_cores_before:.1f} cores before the run; "
                f"neighbours used {self.neighbour_cores:.1f} cores during it]")


def trainbpf_cli() -> Path:
    """The console script installed beside the interpreter running the tests."""
    return Path(sys.executable).parent / "trainbpf"


def fake_gpu_env(workdir: Path) -> dict[str, str]:
    """Environment for workload and recorder: the stand-in nvidia-smi first on PATH and
    a simulated-GPU file private to this run."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "nvidia-smi"
    if not link.exists():
        link.symlink_to(FAKE_SMI)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["TRAINBPF_SIM_GPU"] = str(workdir / "sim-gpu")
    return env


def fake_nvml_env(workdir: Path) -> dict[str, str]:
    """Environment for workload and recorder with the same simulated GPU behind NVML:
    the stand-in libnvidia-ml.so.1 (scripts/fake-nvml) built into workdir/nvml and first
    on LD_LIBRARY_PATH, and no nvidia-smi on PATH, so that `--gpu auto` can only take
    NVML."""
    lib_dir = build_fake_nvml(workdir / "nvml").parent
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not os.access(os.path.join(d, "nvidia-smi"), os.X_OK))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib_dir), env.get("LD_LIBRARY_PATH")]))
    env["TRAINBPF_SIM_GPU"] = str(workdir / "sim-gpu")
    return env


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the stand-in NVML library into `out_dir`; its path."""
    spec = importlib.util.spec_from_file_location("fake_nvml_build", FAKE_NVML_BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(out_dir)


# --- one run ---------------------------------------------------------------------------


@contextlib.contextmanager
def running_workload(scenario: Scenario, env: dict, workdir: Path,
                     cgroup: MemoryCgroup | None = None, extra_args: tuple[str, ...] = ()):
    """Start the workload, wait for its `ready pid=N` line, yield the process, stop it."""
    script = WORKLOADS / f"{scenario.name}.py"
    log = open(workdir / "workload.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(script), "--seconds", str(WORKLOAD_SECONDS), *extra_args],
        env=env, stdout=subprocess.PIPE, stderr=log,
        preexec_fn=cgroup.add_self if cgroup else None,
    )
    try:
        line = _read_line(proc, READY_TIMEOUT_S)
        if line != f"ready pid={proc.pid}":
            raise ScenarioError(f"{scenario.name} did not start: {line!r}; "
                                f"log: {_tail(workdir / 'workload.log')}")
        yield proc
    finally:
        stop_process(proc)
        log.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return f"(no line within {timeout} s)"
    return proc.stdout.readline().decode(errors="replace").strip()


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def run_scenario(scenario: Scenario, workdir: Path, gpu_source: str = "nvidia-smi", *,
                 recorder_pythonpath: Path | None = None) -> ScenarioResult:
    """Record the scenario's workload for RECORD_SECONDS, sampling the simulated GPU
    through `gpu_source` ("nvidia-smi" or "nvml"), and analyse the trace.  With
    `recorder_pythonpath` the recording is made by the trainbpf package found there
    (another revision's, scripts/compare_scenarios.py), the analysis by this one."""
    return run_scenario_recorders(scenario, workdir, gpu_source, {"": recorder_pythonpath})[""]


def run_scenario_recorders(scenario: Scenario, workdir: Path, gpu_source: str,
                           recorders: dict[str, Path | None]) -> dict[str, ScenarioResult]:
    """The scenario recorded by each of `recorders` (name -> the trainbpf package's
    PYTHONPATH, None for this one), all at once when there are several: the same run of
    the workload seen by each, each trace analysed by this revision over the same
    RECORD_SECONDS of load.  One recorder starts the load once its probes attach and
    records for RECORD_SECONDS; several start it once all have attached and are stopped
    together (SIGINT), each trace analysed over the window of the load."""
    cli = trainbpf_cli()
    env = fake_gpu_env(workdir) if gpu_source == "nvidia-smi" else fake_nvml_env(workdir)
    together = len(recorders) > 1

    def own(stem: str, name: str, suffix: str) -> Path:
        """workdir/STEM.SUFFIX, one per recorder (STEM-NAME.SUFFIX) when several record."""
        return workdir / (f"{stem}-{name.replace(' ', '_')}{suffix}" if together else f"{stem}{suffix}")

    traces = {name: own(scenario.name, name, ".parquet") for name in recorders}
    record_args = ["--gpu", gpu_source] + (["--probes", scenario.probes] if scenario.probes else [])
    # The spool appears once the probes are compiled and attaching: start the load then.
    go = workdir / "go" if together else spool_path_for(next(iter(traces.values())))
    workload_args: tuple[str, ...] = ("--hold-until", str(go), *scenario.variant)
    if scenario.step_ms is not None:
        workload_args += ("--step-ms", str(scenario.step_ms))
    if scenario.declares_topology:
        topology = workdir / "topology.json"
        workload_args += ("--topology-out", str(topology))
        record_args += ["--topology", str(topology)]
    busy_before = wait_for_quiet()
    with contextlib.ExitStack() as bent:
        if scenario.dirty_limits:
            bent.enter_context(lowered_dirty_limits(*scenario.dirty_limits))
        cgroup = None
        if scenario.memory_limit:
            cgroup = bent.enter_context(memory_cgroup(scenario.memory_limit))
        if scenario.store_delay_ms is not None:
            link = bent.enter_context(store_namespace(scenario.link_mbit))
            workload_args += ("--store", bent.enter_context(store_server(link, scenario.store_delay_ms)))
        workload = bent.enter_context(
            running_workload(scenario, env, workdir, cgroup, workload_args))
        neighbours = NeighbourMeter(workload.pid)
        neighbours.start()
        procs = {name: _start_recorder(cli, pythonpath, env, [
            "record", "--pid", str(workload.pid), "-o", str(traces[name]), *record_args,
            *([] if together else ["--duration", f"{scenario.record_seconds:g}"])]) for name, pythonpath in recorders.items()}
        go_ns = _record_together(procs, traces, go) if together else 0
        recorded = {name: _finished(p) for name, p in procs.items()}
        neighbour_cores = neighbours.stop()
        for name, (rc, log) in recorded.items():
            own("record", name, ".log").write_text(log)
            if rc != 0:
                raise ScenarioError(f"trainbpf record{' (' + name + ')' if together else ''} exited {rc}: "
                                    f"{log.strip()[-2000:]}")
        if workload.poll() is not None:
            raise ScenarioError(f"{scenario.name} exited during the recording "
                                f"({workload.returncode}): {_tail(workdir / 'workload.log')}")
    results = {}
    for name, trace in traces.items():
        window = []
        if together:  # the load's seconds, from this trace's own start
            start_s = (go_ns - trace_start_ns(trace)) / 1e9
            window = ["--window", f"{start_s:.3f}:{start_s + RECORD_SECONDS:.3f}"]
        report = _analysed(cli, trace, window, own("report", name, ".json"))
        results[name] = ScenarioResult(scenario, gpu_source, report, trace, workdir, busy_before, neighbour_cores)
    return results



def _start_recorder(cli: Path, pythonpath: Path | None, env: dict, args: list[str]) -> subprocess.Popen:
    """`trainbpf ARGS` by this revision's CLI, or by the package at `pythonpath` (run from
    there: `-m` puts the working directory first on the path, and from the repository's
    root that is this revision's package)."""
    cmd = [str(cli)] if pythonpath is None else [sys.executable, "-m", "trainbpf.cli"]
    return subprocess.Popen([*cmd, *args], env=env if pythonpath is None else {**env, "PYTHONPATH": str(pythonpath)},
                            cwd=None if pythonpath is None else str(pythonpath),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _record_together(procs: dict[str, subprocess.Popen], traces: dict[str, Path], go: Path) -> int:
    """Start the load once every recorder's probes attach (its spool appears), let them
    record RECORD_SECONDS of it, stop them all (SIGINT); the load's start (monotonic ns)."""
    deadline = time.monotonic() + RECORD_TIMEOUT_S
    while not all(spool_path_for(t).exists() for t in traces.values()):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
            break
        time.sleep(0.05)
    time.sleep(1.0)  # the spool appears as the probes attach: let every one finish
    go_ns = time.monotonic_ns()
    go.touch()
    time.sleep(RECORD_SECONDS)
    for p in procs.values():
        p.send_signal(signal.SIGINT)
    return go_ns


def _finished(p: subprocess.Popen) -> tuple[int, str]:
    """A recorder's exit status and output, once it exits (killed after RECORD_TIMEOUT_S)."""
    try:
        out, err = p.communicate(timeout=RECORD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out + err


def _analysed(cli: Path, trace: Path, window: list[str], report_path: Path) -> dict:
    """The JSON report of `trace` (over `window`: --window arguments), kept at `report_path`."""
    analyzed = subprocess.run([str(cli), "analyze", str(trace), "--format", "json", *window],
                              capture_output=True, text=True, timeout=ANALYZE_TIMEOUT_S)
    if analyzed.returncode != 0:
        raise ScenarioError(f"trainbpf analyze exited {analyzed.returncode}: "
                            f"{analyzed.stderr.strip()[-2000:]}")
    report_path.write_text(analyzed.stdout)
    try:
        return json.loads(analyzed.stdout)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"trainbpf analyze --format json printed no JSON: {exc}") from exc


def trace_start_ns(trace: Path) -> int:
    """The recording's start on CLOCK_MONOTONIC, from the trace's metadata."""
    import pyarrow.parquet as pq

    from trainbpf.trace.meta import decode_meta

    return int(decode_meta(pq.read_schema(trace).metadata, trace)["clock"]["start_mono_ns"])
