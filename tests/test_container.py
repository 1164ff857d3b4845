"""Tracing a trainer in a container from the host (docs/containers.md): its own pid and
mount namespaces, a root file system whose CPython (3.12) is not the recorder's and lives
at a path the host does not have, and a Kubernetes pod's cgroup.  The recorder is given
the host's pid; it must name the Python frames, tell the threads' roles, find the
injected cause and record which container it was."""

from __future__ import annotations

import glob
import json
import subprocess
from pathlib import Path

import pytest

from container_env import CONTAINER_PYTHON, DATA, WORKLOADS, container
from kernel_env import PYENV, PYTHON_VERSIONS, missing, python_interpreter, require_root
from scenario_harness import WORKLOADS as HOST_WORKLOADS
from scenario_harness import fake_gpu_env, trainbpf_cli
from scenario_machine import wait_for_quiet
from standins import build_standin
from trainbpf.doctor import process_cuda
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import spool_path_for

TESTS = Path(__file__).resolve().parent
CONTAINER_CUDA = "/opt/cuda"  # the CUDA libraries' folder inside the container (not on the host)
CONTAINER_TESTS = "/tests"
RECORD_SECONDS = 5
# input_pipeline: one dataloader thread slower than the GPU (one busy core: a second
# decoding thread on this two-core machine can make the wait for a core the top cause)
WORKLOAD = "interleaved_steps"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_root("makes namespaces, mounts and cgroups, and loads BPF programs")
    python_interpreter("3.12")  # skipped (failed in CI) where pyenv's 3.12 is missing
    workdir = tmp_path_factory.mktemp("container")
    trace = workdir / "trace.parquet"
    spool = spool_path_for(trace)
    argv = [f"{CONTAINER_PYTHON}/bin/python3.12", f"{WORKLOADS}/{WORKLOAD}.py", "--seconds", "300",
            "--hold-until", f"{DATA}/{spool.relative_to(workdir)}"]
    inside = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": f"{CONTAINER_PYTHON}/lib",
              "TRAINBPF_SIM_GPU": f"{DATA}/sim-gpu", "PYTHONDONTWRITEBYTECODE": "1"}
    python_home = PYENV / PYTHON_VERSIONS["3.12"]
    wait_for_quiet()
    # Ahead of the machine's other load (it has two cores): its one injected cause, not
    # a wait for a core that other programs hold, is what the test is about.
    with container(workdir, python_home, HOST_WORKLOADS, argv, inside, nice=-10) as box:
        assert box.host_pid != box.ns_pid, "the workload should see another pid than the host's"
        rec = subprocess.run([str(trainbpf_cli()), "record", "--pid", str(box.host_pid), "-o", str(trace),
                              "--gpu", "nvidia-smi", "--duration", str(RECORD_SECONDS)],
                             env=fake_gpu_env(workdir), capture_output=True, text=True, timeout=180)
        assert rec.returncode == 0, rec.stderr[-3000:]
        assert box.init.poll() is None, "the container ended during the recording"
    reports = {}
    for fmt in ("json", "text"):
        out = subprocess.run([str(trainbpf_cli()), "analyze", str(trace), "--format", fmt],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        reports[fmt] = out.stdout
    return box, json.loads(reports["json"]), reports["text"], rec.stderr


def test_container_frames_named(recorded):
    """The container's CPython (3.12, not the recorder's, at a path only the container
    has) is found and its frames named: the workload's own functions in the report."""
    _, _, text, log = recorded
    # The trainer waits in next_batch; the dataloader thread decodes (burns CPU) in common.py.
    assert "next_batch" in text and "_burn_cpu_hashing" in text, (log[-2000:], text[-3000:])


def test_container_roles_and_cause(recorded):
    _, report, text, _ = recorded
    top = report["findings"][0] if report["findings"] else None
    assert top is not None and top["category"] == "input_pipeline", text[-3000:]
    roles = {t["role"] for t in top["threads"]}
    assert "dataloader" in roles, top["threads"]
    assert "trainer" in {t["role"] for t in report.get("threads", [])} or "trainer" in text, text[-3000:]


def test_container_identity_recorded(recorded):
    box, report, text, _ = recorded
    ident = report["container"]
    assert (ident["id"], ident["runtime"], ident["pod_uid"]) == (box.container_id, "containerd", box.pod_uid), ident
    assert ident["cgroup"] == box.cgroup
    assert box.container_id[:12] in text


def test_container_cuda_library(tmp_path):
    """The container's CUDA runtime (the stand-in libcudart, at /opt/cuda/..., a path the
    host does not have) is found in its maps and probed through the mapped file: the
    workload waits for the uprobes before it trains, and its GPU waits are in the trace."""
    require_root("makes namespaces, mounts and cgroups, and loads BPF programs")
    python_interpreter("3.12")
    wheel = tmp_path / "wheel"
    runtime = build_standin("fake-cuda", wheel)
    trace = tmp_path / "trace.parquet"
    argv = [f"{CONTAINER_PYTHON}/bin/python3.12", f"{CONTAINER_TESTS}/cuda_workloads.py",
            "--runtime", f"{CONTAINER_CUDA}/{runtime.relative_to(wheel)}", "--truth", f"{DATA}/truth.json",
            "--hold-until", f"{DATA}/{spool_path_for(trace).name}", "--seconds", "4"]
    inside = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": f"{CONTAINER_PYTHON}/lib", "PYTHONDONTWRITEBYTECODE": "1"}
    with container(tmp_path, PYENV / PYTHON_VERSIONS["3.12"], HOST_WORKLOADS, argv, inside,
                   extra={CONTAINER_CUDA: wheel, CONTAINER_TESTS: TESTS}) as box:
        rec = subprocess.run([str(trainbpf_cli()), "record", "--pid", str(box.host_pid), "-o", str(trace),
                              "--gpu", "off", "--probes", "sched,futex,cuda", "--duration", "60"],
                             capture_output=True, text=True, timeout=180)
        assert rec.returncode == 0, rec.stderr[-3000:]
        assert box.init.wait(timeout=30) == 0, (tmp_path / "container.log").read_text()[-2000:]
    data = read_trace(trace)
    libraries = data.meta["cuda"]["libraries"]
    probed = {lib["path"]: lib["symbols"] for lib in libraries}
    assert any(path.startswith(CONTAINER_CUDA) and symbols for path, symbols in probed.items()), libraries
    assert not Path(CONTAINER_CUDA).exists(), "the test means a library path only the container has"
    waits = data.view("cuda_call")
    assert len(waits) and set(waits["pid"].astype(int)) == {box.host_pid}, waits.head()


def test_container_real_cuda_runtime_read_from_the_mapped_file(tmp_path):
    """The real libcudart (/usr/local/cuda*/lib*), mapped from a folder that only the
    process's mount namespace fills (on the host the same path is an empty folder): its
    probed calls are read from the file mapped (what `record` attaches to, and what
    `doctor --cuda` lists), not from the host's path."""
    require_root("makes a mount namespace")
    real = sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so.*[0-9]"))
    if not real:
        missing("no real libcudart under /usr/local/cuda*/lib*")  # a failure in CI
    inside = tmp_path / "cuda"
    inside.mkdir()
    lib = inside / Path(real[-1]).name
    script = (f"mount --make-rprivate / && mount --bind {Path(real[-1]).parent} {inside} && exec python3 -c "
              f"'import ctypes, time; ctypes.CDLL(\"{lib}\"); print(\"ready\", flush=True); time.sleep(60)'")
    proc = subprocess.Popen(["unshare", "--mount", "--fork", "--kill-child", "sh", "-c", script],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        pid = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        assert not lib.exists(), "the library's path should lead nowhere on the host"
        found = process_cuda(pid)
        assert [path for path, _ in found] == [str(lib)], found
        calls = {call for _, call in found[0][1]}
        assert {"cudaLaunchKernel", "cudaStreamSynchronize", "cudaMalloc"} <= calls, found
    finally:
        proc.kill()  # --kill-child: the python inside goes with it
        proc.wait()
