"""The nvidia-smi stand-in: output format, utilisation from the simulated GPU, exit."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAKE_SMI = Path(__file__).resolve().parent.parent / "scripts" / "fake-nvidia-smi"
RECORDER_QUERY = [
    "--query-gpu=timestamp,index,uuid,pci.bus_id,utilization.gpu,utilization.memory,memory.used",
    "--format=csv,noheader,nounits",
    "-lms",
    "100",
]
LINE = re.compile(
    r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{3}), (\d+), (GPU-[0-9a-f-]{36}), "
    r"([0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.\d), (\d+), (\d+), (\d+)$"
)


def load_fake_smi():
    loader = importlib.machinery.SourceFileLoader("fake_nvidia_smi", str(FAKE_SMI))
    spec = importlib.util.spec_from_loader("fake_nvidia_smi", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


smi = load_fake_smi()


def test_busy_percent_is_the_covered_part_of_the_window():
    assert smi.busy_percent([], 0, 100) == 0
    assert smi.busy_percent([(0, 100)], 0, 100) == 100
    assert smi.busy_percent([(-50, 25)], 0, 100) == 25  # clipped at the window start
    assert smi.busy_percent([(90, 500)], 0, 100) == 10  # a step still running
    # Overlapping intervals count once.
    assert smi.busy_percent([(10, 40), (30, 60), (70, 80)], 0, 100) == 60
    assert smi.busy_percent([(30, 60), (10, 40)], 0, 100) == 50


def test_tail_reading_skips_partial_lines_and_reaches_back_far_enough(tmp_path):
    path = tmp_path / "sim"
    lines = [f"{i * 1000} {i * 1000 + 500}\n" for i in range(20_000)]  # > TAIL_BYTES
    path.write_text("".join(lines) + "99999999 999")  # last line still being written
    intervals = smi.read_busy_intervals(str(path), since_ns=10_000 * 1000)
    assert intervals[-1] == (19_999_000, 19_999_500)
    assert intervals[0][1] <= 10_000 * 1000  # read back past the window start
    assert all(end > start for start, end in intervals)
    assert smi.read_busy_intervals(str(tmp_path / "missing"), since_ns=0) == []


def test_a_third_field_naming_the_process_is_ignored(tmp_path):
    path = tmp_path / "sim"
    # "start end pid" lines are the NVML stand-in's per-process work: the same busy time.
    path.write_text("100 200\n300 400 4242\n500 600 1 2\n")
    assert smi.read_busy_intervals(str(path), since_ns=0) == [(100, 200), (300, 400)]


def run_smi(args, env_extra, *, seconds=None):
    env = {**os.environ, **env_extra}
    if seconds is None:
        return subprocess.run([str(FAKE_SMI), *args], env=env, capture_output=True, text=True,
                              timeout=20)
    proc = subprocess.Popen([str(FAKE_SMI), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(seconds)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_recorder_query_prints_nvidia_smi_lines_until_sigterm(tmp_path):
    sim = tmp_path / "sim"
    now = time.monotonic_ns()
    sim.write_text(f"{now - 10**9} {now + 60 * 10**9}\n")  # busy from before to after
    result = run_smi(RECORDER_QUERY, {"TRAINBPF_SIM_GPU": str(sim)}, seconds=1.0)
    assert result.returncode == 0
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert 5 <= len(lines) <= 15  # about one every 100 ms
    for line in lines:
        match = LINE.match(line)
        assert match, line
        assert match.group(2) == "0"
        assert match.group(5) == "100"
    stamps = [time.mktime(time.strptime(LINE.match(x).group(1)[:19], "%Y/%m/%d %H:%M:%S"))
              for x in lines]
    assert abs(stamps[0] - time.time()) < 10  # local wall-clock time


def test_no_simulated_gpu_file_means_idle(tmp_path):
    result = run_smi(RECORDER_QUERY, {"TRAINBPF_SIM_GPU": str(tmp_path / "none")},
                     seconds=0.5)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines and all(LINE.match(x).group(5) == "0" for x in lines)


def test_half_busy_gpu_reads_about_half(tmp_path):
    sim = tmp_path / "sim"
    now = time.monotonic_ns()
    ms = 10**6
    # 20 ms busy in every 40 ms, for the next few seconds.
    sim.write_text("".join(f"{now + k * 40 * ms} {now + k * 40 * ms + 20 * ms}\n"
                           for k in range(100)))
    result = run_smi(RECORDER_QUERY, {"TRAINBPF_SIM_GPU": str(sim)}, seconds=1.2)
    utils = [int(LINE.match(x).group(5)) for x in result.stdout.splitlines()[1:]]
    assert utils and all(40 <= u <= 60 for u in utils), utils


def test_one_line_per_gpu_per_interval(tmp_path):
    result = run_smi(RECORDER_QUERY, {"TRAINBPF_SIM_GPU": str(tmp_path / "sim"),
                                      "TRAINBPF_SIM_GPU_COUNT": "2"}, seconds=0.5)
    indexes = [LINE.match(x).group(2) for x in result.stdout.splitlines()]
    assert indexes[:4] == ["0", "1", "0", "1"]
    uuids = {LINE.match(x).group(3) for x in result.stdout.splitlines()}
    assert len(uuids) == 2


def test_list_gpus():
    result = run_smi(["-L"], {})
    assert result.returncode == 0
    assert re.fullmatch(r"GPU 0: Fake GPU \(UUID: GPU-[0-9a-f-]{36}\)\n", result.stdout)


def test_single_query_with_header_and_units():
    result = run_smi(["--query-gpu=utilization.gpu,memory.used", "--format=csv"], {})
    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == "utilization.gpu [%], memory.used [MiB]"
    assert re.fullmatch(r"\d+ %, \d+ MiB", result.stdout.splitlines()[1])


@pytest.mark.parametrize("args", [["--query-gpu=no.such.field", "--format=csv"],
                                  ["--bogus"], [*RECORDER_QUERY[:2], "-lms", "x"]])
def test_bad_invocations_fail_like_nvidia_smi(args):
    result = run_smi(args, {})
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr


def test_runs_with_a_plain_python(tmp_path):
    # The shebang interpreter may lack the venv's packages: stdlib only.
    result = subprocess.run([sys.executable, "-I", "-S", str(FAKE_SMI), "-L"],
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stderr


def test_compute_apps_lists_the_live_processes_that_drove_each_gpu(tmp_path):
    sim = tmp_path / "gpu"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / "gpu.pids").write_text(f"{os.getpid()}\n{gone}\n")
    (tmp_path / "gpu.1.pids").write_text(f"{os.getppid()}\n")
    env = {"TRAINBPF_SIM_GPU": str(sim), "TRAINBPF_SIM_GPU_COUNT": "2"}
    result = run_smi(["--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader,nounits"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{os.getpid()}, {smi.gpu_uuid(0)}", f"{os.getppid()}, {smi.gpu_uuid(1)}"]


def test_compute_apps_without_processes_prints_nothing(tmp_path):
    result = run_smi(["--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                     {"TRAINBPF_SIM_GPU": str(tmp_path / "none")})
    assert result.returncode == 0 and result.stdout == ""
