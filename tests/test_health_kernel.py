"""`trainbpf health` for real: short recordings through the command line (and the
scheduler wrapper), stand-in training processes, the lock, the time limit, probes gone
afterwards, and node_exporter serving the textfile."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernel_env import require_root, stop_process, which_or_fail, without_cap_syslog
from test_health_outputs import parse_exposition
from trainbpf.health.config import NODE_CHECKS, TEXTFILE_NAME

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[1]
TRAINBPF = str(ROOT / ".venv/bin/trainbpf") if (ROOT / ".venv/bin/trainbpf").exists() else None
NO_MATCH = r"\bno-such-launcher-7f3a\b"

# A stand-in training process: holds argv[1] open unless "-", then spins or sleeps.
STANDIN = """
import sys, time
held = open(sys.argv[1]) if sys.argv[1] != "-" else None
if sys.argv[2] == "spin":
    while True:
        pass
while True:
    time.sleep(0.05)
"""


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    elapsed: float
    prog_ids: set[int]
    doc: dict | None
    textfile: Path

    @property
    def samples(self) -> dict:
        return parse_exposition(self.textfile.read_text())


def trainbpf_cmd() -> list[str]:
    return [TRAINBPF] if TRAINBPF else [sys.executable, "-m", "trainbpf.cli"]


def write_config(folder: Path, *, thresholds: dict[str, tuple[float, float]] | None = None, gpu: str = "off",
                 **keys) -> Path:
    """A config in `folder` with its own lock; node checks off unless `thresholds` names them."""
    levels = {name: (float("inf"), float("inf")) for name in NODE_CHECKS}
    levels.update(thresholds or {})
    lines = [f'lock_file = "{folder / "health.lock"}"', f'gpu = "{gpu}"']
    keys.setdefault("device_glob", str(folder / "no-device*"))
    keys.setdefault("command_patterns", [NO_MATCH])
    for key, value in keys.items():
        lines.append(f"{key} = {json.dumps(value)}")
    lines.append("[thresholds]")
    for name, (warning, critical) in levels.items():
        lines.append(f"{name} = {{ warning = {warning}, critical = {critical} }}")
    path = folder / "health.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def watch_programs(pid: int, ids: set[int], stop: threading.Event) -> None:
    """Collect the ids of the BPF programs process `pid` holds, until it ends."""
    while not stop.is_set():
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except FileNotFoundError:
            return
        for fd in fds:
            try:
                text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            except OSError:
                continue
            m = re.search(r"^prog_id:\s+(\d+)", text, re.M)
            if m:
                ids.add(int(m.group(1)))
        time.sleep(0.02)


def start_health(folder: Path, *args: str, command: list[str] | None = None, env: dict | None = None):
    out = folder / "out"
    out.mkdir(exist_ok=True)
    cmd = (command or [*trainbpf_cmd(), "health"]) + ["--textfile-dir", str(out), "--json", str(out / "health.json"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or dict(os.environ))
    ids: set[int] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=watch_programs, args=(proc.pid, ids, stop), daemon=True)
    watcher.start()
    return proc, ids, stop, watcher, out


def finish(started, *, t0: float, timeout: float = 240) -> Run:
    proc, ids, stop, watcher, out = started
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop.set()
        watcher.join()
    elapsed = time.monotonic() - t0
    doc_path = out / "health.json"
    doc = json.loads(doc_path.read_text()) if doc_path.exists() else None
    return Run(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), elapsed, ids, doc, out / TEXTFILE_NAME)


def run_health(folder: Path, *args: str, **kwargs) -> Run:
    t0 = time.monotonic()
    return finish(start_health(folder, *args, **kwargs), t0=t0)


def assert_programs_gone(run: Run) -> None:
    bpftool = which_or_fail("bpftool", "bpftool")
    assert run.prog_ids, "saw no BPF program in the health process: the check is vacuous"
    alive = [i for i in sorted(run.prog_ids)
             if subprocess.run([bpftool, "prog", "show", "id", str(i)], capture_output=True).returncode == 0]
    assert not alive, f"BPF programs {alive} still loaded after the health check ended"


@pytest.fixture
def standin(tmp_path):
    procs = []

    def start(mode: str, *, hold: Path | None = None, extra: tuple[str, ...] = ()) -> int:
        proc = subprocess.Popen([sys.executable, "-c", STANDIN, str(hold) if hold else "-", mode, *extra])
        procs.append(proc)
        if hold is not None:  # wait until the file is open
            deadline = time.monotonic() + 10
            while str(hold) not in {os.path.realpath(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")}:
                assert time.monotonic() < deadline, "stand-in never opened its device file"
                time.sleep(0.05)
        else:
            time.sleep(0.3)
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def node_run(tmp_path_factory):
    """One check with no training process on the machine: the node-level mode."""
    require_root()
    folder = tmp_path_factory.mktemp("node")
    config = write_config(folder, thresholds={"cpu_pressure_ratio": (0.5, 0.9), "runqueue_latency_p99_seconds": (0.01, 0.05)})
    return run_health(folder, "--duration", "2", "--config", str(config))


def test_no_target_checks_the_node_from_a_system_wide_trace(node_run):
    run = node_run
    assert run.doc is not None, run.proc.stderr
    assert run.proc.returncode == run.doc["exit_code"] in (0, 1, 2), run.proc.stderr
    assert (run.doc["mode"], run.doc["targets"], run.doc["error"]) == ("node", [], None)
    node = run.doc["node"]
    assert node["system_wide"] is True
    assert 1.5 < node["recorded_seconds"] < 10
    assert node["runqueue_latency_p99_seconds"] > 0 and node["runqueue_seconds"] > 0
    assert 0 <= node["pressure"]["cpu.some"] <= 1
    checks = {c["check"]: c for c in run.doc["checks"]}
    assert set(checks) == set(NODE_CHECKS)
    expected = max({"ok": 0, "warning": 1, "critical": 2}[c["status"]] for c in checks.values())
    assert run.proc.returncode == expected
    assert run.proc.stdout.startswith(f"trainbpf health: {run.doc['status']} ({expected})")
    for path in (run.textfile, run.textfile.with_name("health.json")):
        assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in run.textfile.parent.iterdir()) == ["health.json", TEXTFILE_NAME]


def test_no_probes_left_after_a_run(node_run):
    assert_programs_gone(node_run)


@pytest.fixture
def node_exporter(node_run):
    exe = which_or_fail("prometheus-node-exporter", "prometheus-node-exporter")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                             "--collector.textfile", f"--collector.textfile.directory={node_run.textfile.parent}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None, f"node_exporter exited: {proc.stderr.read()}"
                assert time.monotonic() < deadline, "node_exporter did not start listening"
                time.sleep(0.1)
        yield url
    finally:
        stop_process(proc, timeout=10)


def test_node_exporter_serves_the_metrics(node_run, node_exporter):
    body = urllib.request.urlopen(node_exporter, timeout=10).read().decode()
    lines = body.splitlines()
    assert "node_textfile_scrape_error 0" in lines
    assert any(line.startswith("node_textfile_mtime_seconds{") and f'{TEXTFILE_NAME}"' in line for line in lines)
    scraped = {k: v for k, v in parse_exposition("\n".join(l for l in lines if l.startswith("trainbpf_"))).items()}
    assert scraped == node_run.samples, "node_exporter changed or dropped samples"
    doc = node_run.doc
    assert scraped[("trainbpf_health_status", ())] == doc["exit_code"]
    assert scraped[("trainbpf_health_targets", ())] == 0
    assert scraped[("trainbpf_health_system_wide", ())] == 1
    assert scraped[("trainbpf_node_runqueue_latency_p99_seconds", ())] == doc["node"]["runqueue_latency_p99_seconds"]
    assert scraped[("trainbpf_node_pressure_ratio", (("kind", "some"), ("resource", "cpu")))] == doc["node"]["pressure"]["cpu.some"]
    assert scraped[("trainbpf_health_last_run_timestamp_seconds", ())] == doc["finished_timestamp"]
    for check in doc["checks"]:
        status = {"ok": 0, "warning": 1, "critical": 2}[check["status"]]
        assert scraped[("trainbpf_health_check_status", (("check", check["check"]),))] == status
    assert "# HELP trainbpf_health_status Outcome of the last health check" in body
    assert "# TYPE trainbpf_node_pressure_ratio gauge" in body


def lock_is_held(path: Path) -> bool:
    if not path.exists():
        return False
    with open(path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def test_device_holder_is_found_critical_and_a_second_run_skips(tmp_path, standin):
    require_root()
    device = tmp_path / "fake-nvidia0"
    device.write_text("")
    pid = standin("sleep", hold=device)
    config = write_config(tmp_path, device_glob=str(tmp_path / "fake-nvidia*"), thresholds={"starved_ratio": (0.5, 0.8)})
    t0 = time.monotonic()
    first = start_health(tmp_path, "--duration", "3", "--config", str(config))
    deadline = time.monotonic() + 30
    while not lock_is_held(tmp_path / "health.lock"):
        assert first[0].poll() is None, first[0].communicate()
        assert time.monotonic() < deadline, "the first run never took its lock"
        time.sleep(0.05)

    second_dir = tmp_path / "second"
    second_dir.mkdir()
    second = subprocess.run([*trainbpf_cmd(), "health", "--config", str(config), "--json", str(second_dir / "h.json"),
                             "--textfile-dir", str(second_dir)], capture_output=True, text=True, timeout=60)
    assert second.returncode == 3
    assert f"holds {tmp_path / 'health.lock'}; this run skipped" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    assert list(second_dir.iterdir()) == [], "a skipped run must not touch the outputs"
    assert first[0].poll() is None, "the first run should still be running"

    run = finish(first, t0=t0)
    assert run.proc.returncode == 2, (run.proc.stdout, run.proc.stderr)
    assert [(t["pid"], t["reason"]) for t in run.doc["targets"]] == [(pid, "device")]
    target = run.doc["targets"][0]
    assert target["status"] == "critical" and target["starved_ratio"] >= 0.8
    assert run.doc["node"]["system_wide"] is False
    assert run.samples[("trainbpf_target_status", (("pid", str(pid)),))] == 2
    assert run.samples[("trainbpf_target_starved_ratio", (("pid", str(pid)),))] == target["starved_ratio"]
    assert run.samples[("trainbpf_thread_state_seconds", (("pid", str(pid)), ("role", "trainer"), ("state", "sleep")))] > 1.0
    assert f"pid {pid} python" in run.proc.stdout and "critical" in run.proc.stdout
    assert_programs_gone(run)


def test_launcher_pattern_finds_a_spinning_stand_in_healthy(tmp_path, standin):
    require_root()
    pid = standin("spin", extra=("torchrun", "--nproc-per-node", "1"))
    config = write_config(tmp_path, command_patterns=[r"\btorchrun\b"], thresholds={"starved_ratio": (0.9, 0.95)})
    run = run_health(tmp_path, "--duration", "2", "--config", str(config))
    assert run.proc.returncode == 0, (run.proc.stdout, run.proc.stderr)
    assert [(t["pid"], t["reason"]) for t in run.doc["targets"]] == [(pid, "pattern")]
    assert run.doc["targets"][0]["starved_ratio"] < 0.9
    assert run.samples[("trainbpf_health_status", ())] == 0


def test_given_pid_through_the_wrapper_warns(tmp_path, standin):
    require_root()
    pid = standin("sleep")
    config = write_config(tmp_path, thresholds={"starved_ratio": (0.5, float("inf"))})
    env = {**os.environ, "TRAINBPF_HEALTH_CONFIG": str(config), "TRAINBPF_HEALTH_ARGS": f"--pid {pid}"}
    run = run_health(tmp_path, "--duration", "2", command=[str(ROOT / "scripts/trainbpf-health")], env=env)
    assert run.proc.returncode == 1, (run.proc.stdout, run.proc.stderr)
    assert [(t["pid"], t["reason"], t["status"]) for t in run.doc["targets"]] == [(pid, "pid", "warning")]
    checks = [c for c in run.doc["checks"] if c["check"] == "starved_ratio"]
    assert checks == [{"check": "starved_ratio", "pid": pid, "value": run.doc["targets"][0]["starved_ratio"],
                       "warning": 0.5, "critical": None, "status": "warning"}]


def test_missing_pid_is_could_not_check_and_says_so_in_the_outputs(tmp_path):
    require_root()
    config = write_config(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    run = run_health(tmp_path, "--pid", str(dead.pid), "--config", str(config))
    assert run.proc.returncode == 3
    assert run.proc.stderr.strip() == f"trainbpf: error: no such process: {dead.pid} (--pid takes a process id, the kernel's tgid)"
    assert (run.doc["status"], run.doc["error"]) == ("unknown", f"no such process: {dead.pid} (--pid takes a process id, the kernel's tgid)")
    assert run.samples[("trainbpf_health_status", ())] == 3


def test_time_limit_ends_a_long_recording(tmp_path):
    require_root()
    # The limit asks the recorder to stop; it can only once the probes have compiled
    # (seconds, more on a busy machine), and the backstop ends the process 10 s after
    # the limit if it is still running.  Either way: exit 3 long before the 60 s.
    config = write_config(tmp_path, time_limit_s=8)
    run = run_health(tmp_path, "--duration", "60", "--config", str(config))
    assert run.proc.returncode == 3, (run.proc.stdout, run.proc.stderr)
    assert run.elapsed < 30, f"an 8 s limit took {run.elapsed:.0f} s to end the run"
    assert "time limit of 8 s" in run.proc.stderr
    assert run.doc["status"] == "unknown" and "time limit of 8 s" in run.doc["error"]
    assert run.samples[("trainbpf_health_status", ())] == 3
    if "reached while recording" in run.proc.stderr:  # the soft stop: the recorder detached its probes
        assert_programs_gone(run)


def test_hidden_kernel_addresses_fail_the_check_at_once(tmp_path):
    """Without CAP_SYSLOG /proc/kallsyms shows every address as 0: bcc read the whole file
    again for each kernel frame and the check ran into its time limit (63 s for a 3 s
    recording).  It now stops before any probe is loaded, with one line that says why."""
    config = write_config(tmp_path)
    command = [*without_cap_syslog(), *trainbpf_cmd(), "health"]
    run = run_health(tmp_path, "--duration", "3", "--config", str(config), command=command)
    assert run.proc.returncode == 3, (run.proc.stdout, run.proc.stderr)
    assert run.elapsed < 15, f"took {run.elapsed:.0f} s to fail"
    why = "kernel symbols: /proc/kallsyms shows every address as 0 (no CAP_SYSLOG); run `trainbpf doctor`"
    assert run.proc.stderr == f"trainbpf: error: {why}\n", run.proc.stderr
    assert (run.doc["status"], run.doc["error"]) == ("unknown", why)
    assert not run.prog_ids, "probes were loaded"
