"""GPU samples through NVML: the real pynvml against the stand-in libnvidia-ml.so.1
(scripts/fake-nvml), which simulates the GPU the nvidia-smi stand-in does.

pynvml loads the library once per process and the loader reads LD_LIBRARY_PATH at
start, so every configuration runs in a subprocess of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kernel_env import require_root
from scenario_harness import ROOT, fake_nvml_env, trainbpf_cli
from test_fake_nvidia_smi import smi
from synth import healthy, t
from trainbpf.analyzers.timeline.node import node_metrics
from trainbpf.reports.perfetto import run_export
from trainbpf.reports.render import run_analyze
from trainbpf.trace.reader import read_trace
from trainbpf.tracer.samplers.gpu import parse_smi_line, samples_batch

MS = 1_000_000
PERIOD_MS = 50  # a short driver period: more samples in a short test


@pytest.fixture
def nvml_env(tmp_path):
    env = fake_nvml_env(tmp_path)
    env["TRAINBPF_SIM_NVML_SAMPLE_MS"] = str(PERIOD_MS)
    return env


@pytest.fixture
def sleepers():
    """Two live processes to stand as the GPU's compute processes, and one dead pid."""
    live = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    dead = subprocess.Popen(["true"])
    dead.wait()
    yield live[0].pid, live[1].pid, dead.pid
    for p in live:
        p.kill()
        p.wait()


def run_nvml(env: dict, code: str, timeout: float = 60):
    """Run `code` (pynvml imported as nv, NVML initialised) in a fresh interpreter with
    `env`; what it prints as JSON on its last line."""
    prog = "import json, time, ctypes\nimport pynvml as nv\nnv.nvmlInit()\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_periods(path: Path, period_ns: int, busy, *, back_s: float = 3, ahead_s: float = 20) -> None:
    """Busy intervals for every grid period around now: busy(k) -> [(from, to, pid)],
    fractions of the period ending at k * period_ns (pid None: a line without one)."""
    now = time.monotonic_ns()
    lines = []
    for k in range((now - int(back_s * 1e9)) // period_ns, (now + int(ahead_s * 1e9)) // period_ns):
        start = (k - 1) * period_ns
        for a, b, pid in busy(k):
            lines.append(f"{start + int(a * period_ns)} {start + int(b * period_ns)}"
                         + (f" {pid}" if pid else "") + "\n")
    path.write_text("".join(lines))


def quarters(k: int):
    """Period k is (k % 4) * 25 % busy."""
    return [(0.0, (k % 4) / 4, None)] if k % 4 else []


def split(pid_b: int):
    """The first listed pid (lines without a pid) 30 % of each period, pid_b 20 %."""
    return lambda k: [(0.0, 0.3, None), (0.5, 0.7, pid_b)]


SAMPLES = """
h = nv.nvmlDeviceGetHandleByIndex(0)
def samples(kind, last):
    try:
        vt, got = nv.nvmlDeviceGetSamples(h, kind, last)
    except nv.NVMLError_NotFound:
        return None, []
    return vt, [(s.timeStamp, s.sampleValue.uiVal) for s in got]
from trainbpf.tracer.samplers.clock import wall_minus_mono_ns
"""


def test_driver_samples_are_each_period_busy_share_on_a_fixed_grid(nvml_env):
    period = PERIOD_MS * MS
    write_periods(Path(nvml_env["TRAINBPF_SIM_GPU"]), period, quarters)
    out = run_nvml(nvml_env, SAMPLES + """
vt, util = samples(nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
_, mem = samples(nv.NVML_MEMORY_UTILIZATION_SAMPLES, 0)
# read right after: the samples were stamped when first reported, as a driver does
print(json.dumps({"vt": vt, "util": util, "mem": dict(mem), "offset": wall_minus_mono_ns()}))
""")
    assert out["vt"] == 1  # NVML_VALUE_TYPE_UNSIGNED_INT
    util = out["util"]
    assert len(util) == 2000 // PERIOD_MS  # the last 2 s are held
    stamps = [t for t, _ in util]
    assert all(b - a == PERIOD_MS * 1000 for a, b in zip(stamps, stamps[1:])), stamps
    for t, value in util:
        mono = t * 1000 - out["offset"]
        k = round(mono / period)
        assert abs(mono - k * period) < 2 * MS  # wall µs of the grid point k * period
        assert abs(value - (k % 4) * 25) <= 1, (k, value)
        assert out["mem"][str(t)] == value // 2


def test_samples_newer_than_last_seen_and_the_size_query(nvml_env):
    write_periods(Path(nvml_env["TRAINBPF_SIM_GPU"]), PERIOD_MS * MS, quarters)
    out = run_nvml(nvml_env, SAMPLES + """
_, full = samples(nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
_, after = samples(nv.NVML_GPU_UTILIZATION_SAMPLES, full[-3][0])
_, newest = samples(nv.NVML_GPU_UTILIZATION_SAMPLES, 2**63)
fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetSamples")
vt, count = ctypes.c_uint(), ctypes.c_uint(0)
size_ret = fn(h, 1, ctypes.c_ulonglong(full[-7][0]), ctypes.byref(vt), ctypes.byref(count), None)
size = count.value
buf = (nv.c_nvmlSample_t * 3)()
count.value = 3
short_ret = fn(h, 1, ctypes.c_ulonglong(full[-7][0]), ctypes.byref(vt), ctypes.byref(count), buf)
count.value = 0
zero_ret = fn(h, 1, ctypes.c_ulonglong(0), ctypes.byref(vt), ctypes.byref(count), buf)
print(json.dumps({"full": full, "after": after, "newest": newest, "size_ret": size_ret, "size": size,
                  "short_ret": short_ret, "short": [b.timeStamp for b in buf], "zero_ret": zero_ret}))
""")
    full = [t for t, _ in out["full"]]
    after = [t for t, _ in out["after"]]
    # Those after the third newest: the two newer ones, and any that came since.
    assert after[:2] == full[-2:] and all(t > full[-3] for t in after) and len(after) <= 3
    assert out["newest"] == []  # NVML_ERROR_NOT_FOUND: nothing newer
    assert out["size_ret"] == 0 and out["size"] in (6, 7)  # NULL buffer: how many there are
    # A buffer for 3 gets the 3 oldest newer than lastSeen, so reading on loses none.
    assert out["short_ret"] == 0 and out["short"] == full[-6:-3]
    assert out["zero_ret"] == 2  # NVML_ERROR_INVALID_ARGUMENT: a buffer of no entries


def test_process_utilisation_splits_the_work_by_pid(nvml_env, sleepers):
    a, b, dead = sleepers
    sim = Path(nvml_env["TRAINBPF_SIM_GPU"])
    sim.with_name(sim.name + ".pids").write_text(f"{a}\n{dead}\n{b}\n")
    write_periods(sim, PERIOD_MS * MS, split(b))
    out = run_nvml(nvml_env, SAMPLES + """
_, full = samples(nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
per = nv.nvmlDeviceGetProcessUtilization(h, full[-2][0])
whole = nv.nvmlDeviceGetProcessUtilization(h, 0)
fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
count = ctypes.c_uint(0)
null_ret = fn(h, None, ctypes.byref(count), ctypes.c_ulonglong(0))
null_count = count.value
count.value = 1
short_ret = fn(h, (nv.c_nvmlProcessUtilizationSample_t * 1)(), ctypes.byref(count), ctypes.c_ulonglong(0))
running = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
rows = lambda es: {e.pid: [e.timeStamp, e.smUtil, e.memUtil] for e in es}
print(json.dumps({"full": full, "per": rows(per), "whole": rows(whole), "null": [null_ret, null_count],
                  "short": [short_ret, count.value], "running": running}))
""")
    newest, device = out["full"][-1]
    assert abs(device - 50) <= 1
    assert set(out["per"]) == {str(a), str(b)}  # the dead pid is no compute process
    for got in (out["per"], out["whole"]):
        assert abs(got[str(a)][1] - 30) <= 1 and abs(got[str(b)][1] - 20) <= 1, got
        assert got[str(a)][0] >= newest  # the newest sample's time (one may have come since)
    assert out["null"] == [7, 2]  # NVML_ERROR_INSUFFICIENT_SIZE, and the count needed
    assert out["short"] == [7, 2]
    assert sorted(out["running"]) == sorted([a, b])


def test_devices_are_the_nvidia_smi_stand_ins_gpus(tmp_path, sleepers):
    env = {**fake_nvml_env(tmp_path), "TRAINBPF_SIM_GPU_COUNT": "2"}  # the driver's 1/6 s period
    a, b, _ = sleepers
    Path(env["TRAINBPF_SIM_GPU"] + ".1.pids").write_text(f"{b}\n")
    out = run_nvml(env, """
hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
gpus = [[nv.nvmlDeviceGetUUID(h), nv.nvmlDeviceGetPciInfo(h).busId, nv.nvmlDeviceGetMemoryInfo(h).used >> 20,
         [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]] for h in hs]
_, got = nv.nvmlDeviceGetSamples(hs[1], nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
print(json.dumps({"gpus": gpus, "stamps": [s.timeStamp for s in got]}))
""")
    assert out["gpus"] == [[smi.gpu_uuid(0), smi.pci_bus_id(0), smi.MEMORY_USED_MIB, []],
                           [smi.gpu_uuid(1), smi.pci_bus_id(1), smi.MEMORY_USED_MIB, [b]]]
    stamps = out["stamps"]
    assert len(stamps) == 2000 // 167 and {y - x for x, y in zip(stamps, stamps[1:])} == {167_000}


SAMPLER = """
from trainbpf.tracer.samplers.gpu import GpuSampler
s = GpuSampler(mode="nvml")
s.start()
time.sleep(1.2)
s.stop()
batch = s.take()
print(json.dumps({"meta": s.meta(), "counts": [s.count, s.process_count],
                  "rows": batch.to_pandas()[["ts_ns", "dur_ns", "op", "value", "size", "count", "name", "pid"]]
                  .astype(object).where(lambda d: d.notna(), None).values.tolist()}))
"""


def test_sampler_writes_each_driver_sample_on_the_trace_clock(nvml_env, sleepers):
    a, b, _ = sleepers
    period = PERIOD_MS * MS
    sim = Path(nvml_env["TRAINBPF_SIM_GPU"])
    sim.with_name(sim.name + ".pids").write_text(f"{a}\n{b}\n")
    # Device: the quarters pattern, all of it the first pid's but 20 % of each period b's.
    write_periods(sim, period, lambda k: quarters(k) + [(0.8, 1.0, b)])
    out = run_nvml(nvml_env, SAMPLER)
    assert out["meta"] == {"source": "nvml", "sampling": "driver_samples", "sample_period_ns": period}
    rows = out["rows"]
    device = [r for r in rows if r[7] is None]
    procs = [r for r in rows if r[7] is not None]
    assert out["counts"] == [len(device), len(procs)]
    assert 1000 // PERIOD_MS <= len(device) <= 1300 // PERIOD_MS + 1  # one row per sample, none twice
    stamps = [r[0] for r in device]
    assert stamps == sorted(set(stamps))
    for ts, dur, op, value, size, count, name, _ in device:
        k = round(ts / period)
        assert abs(ts - k * period) < 2 * MS  # the end of the sample's period, on CLOCK_MONOTONIC
        assert dur == period  # the first too: reading starts at the newest sample held at start
        assert abs(value - min(100, (k % 4) * 25 + 20)) <= 1, (k, value)
        assert size == value // 2 and count == smi.MEMORY_USED_MIB
        assert (op, name) == (0, smi.gpu_uuid(0))
    assert {r[7] for r in procs} == {a, b}
    for ts, dur, _, value, size, count, _, pid in procs:
        assert abs(ts - round(ts / period) * period) < 2 * MS
        assert dur > 0 and min(dur % period, -dur % period) < 2 * MS  # the samples since the last query
        assert count is None
        # b ran 20 % of every period; a's share is the quarters pattern, averaged.
        assert abs(value - 20) <= 1 if pid == b else 0 <= value <= 75



def test_a_wall_clock_step_during_sampling_moves_no_sample(nvml_env, tmp_path):
    """The driver stamps with the wall clock; the sampler converts each poll's samples with
    the offset of that poll, so a step (NTP, a VM's time agent) shifts nothing."""
    from standin_build import compile_library

    shim = compile_library(tmp_path / "wall_step.so", [ROOT / "tests" / "data" / "wall_step.c"], "-ldl",
                           what="wall-clock step shim")
    period = PERIOD_MS * MS
    write_periods(Path(nvml_env["TRAINBPF_SIM_GPU"]), period, quarters)
    step_env = dict(nvml_env, LD_PRELOAD=str(shim), TRAINBPF_TEST_WALL_STEP_NS=str(5 * MS),
                    TRAINBPF_TEST_WALL_STEP_AFTER_NS=str(500 * MS))
    code = "from trainbpf.tracer.samplers.clock import wall_minus_mono_ns\noffset_at_start = wall_minus_mono_ns()\n" + \
        SAMPLER.replace('{"meta"', '{"step_seen": wall_minus_mono_ns() - offset_at_start, "meta"')
    out = run_nvml(step_env, code)
    assert abs(out["step_seen"] - 5 * MS) < MS / 10  # the shim did step the clock
    device = [r for r in out["rows"] if r[7] is None]
    assert len(device) >= 1000 // PERIOD_MS
    for ts, *_ in device:
        assert abs(ts - round(ts / period) * period) < 2 * MS, ts % period


def test_sampler_reads_rates_when_the_driver_keeps_no_samples(nvml_env):
    write_periods(Path(nvml_env["TRAINBPF_SIM_GPU"]), PERIOD_MS * MS, lambda k: [(0.0, 0.5, None)])
    out = run_nvml({**nvml_env, "TRAINBPF_SIM_NVML_NO_SAMPLES": "1"}, SAMPLER)
    assert out["meta"] == {"source": "nvml", "sampling": "rates", "sample_period_ns": None}
    rows = out["rows"]
    assert 8 <= len(rows) <= 13  # one per 100 ms poll
    assert all(r[1] is None and r[7] is None and abs(r[3] - 50) <= 1 for r in rows)


def test_nvidia_smi_rows_have_no_period_and_no_process():
    line = "2026/12/02 10:23:45.123, 0, GPU-x, 00000000:19:00.0, 87, 45, 40536"
    rows = samples_batch([parse_smi_line(line, 0)]).to_pylist()
    assert rows[0]["dur_ns"] is None and rows[0]["pid"] is None
    assert (rows[0]["value"], rows[0]["size"], rows[0]["count"]) == (87.0, 45, 40536)


def test_reports_and_health_take_process_rows_beside_device_rows(tmp_path):
    """Every reader of `gpu` rows outside the analyzers survives rows with a pid; the
    node check's idle share counts the device's samples, not a neighbour's share."""
    synth = healthy()  # the device 92 % busy every 100 ms
    for ts in np.arange(0.1, synth.duration_s + 1e-9, 0.1):  # an idle neighbour on it
        synth.add("gpu", ts_ns=t(float(ts)), dur_ns=100 * MS, op=0, value=0.0, size=0, name="GPU-0", pid=4242)
    path = synth.write(tmp_path / "t.parquet")
    for fmt in ("text", "json", "html"):
        assert run_analyze(path=path, fmt=fmt, output=tmp_path / f"r.{fmt}") is not None
    assert run_export(path=path, output=tmp_path / "t.json").stat().st_size > 0
    node = node_metrics(read_trace(path))
    assert node["gpu_idle_ratio"] == pytest.approx({"0": 0.08})  # the device's 92%, not the idle neighbour's share


TARGET = """
import sys, time
sys.path.insert(0, sys.argv[1])
from common import SimGpu
gpu = SimGpu()
print("ready", flush=True)
while True:
    gpu.step(0.05)
    time.sleep(0.05)
"""


@pytest.mark.kernel
def test_record_with_gpu_nvml(tmp_path):
    """`trainbpf record --gpu nvml` on the stand-in: driver samples and the target's own
    share in the trace, and the analysis reads them."""
    require_root()
    env = fake_nvml_env(tmp_path)
    target = subprocess.Popen([sys.executable, "-c", TARGET, str(ROOT / "scripts" / "workloads")], env=env,
                              stdout=subprocess.PIPE, text=True)
    out = tmp_path / "t.parquet"
    try:
        assert target.stdout.readline().strip() == "ready"
        rec = subprocess.run([str(trainbpf_cli()), "record", "--pid", str(target.pid), "-d", "3", "--probes", "sched",
                              "--gpu", "nvml", "-o", str(out)], env=env, capture_output=True, text=True, timeout=180)
    finally:
        target.kill()
        target.wait()
    assert rec.returncode == 0, rec.stderr
    trace = read_trace(out)
    meta = trace.meta["gpu"]
    assert (meta["source"], meta["sampling"], meta["sample_period_ns"]) == ("nvml", "driver_samples", 167 * MS)
    assert meta["processes"] == [{"pid": target.pid, "uuid": smi.gpu_uuid(0)}]
    gpu = trace.frame("gpu")
    device, mine = gpu[gpu["pid"].isna()], gpu[gpu["pid"].notna()]
    assert (mine["pid"] == target.pid).all()
    assert meta["samples"] == len(device) >= 2500 // 167 and meta["process_samples"] == len(mine) >= 1
    clock = trace.meta["clock"]
    assert device["ts_ns"].between(clock["start_mono_ns"] - 200 * MS, clock["end_mono_ns"] + 200 * MS).all()
    assert (device["dur_ns"] == 167 * MS).all()
    # 50 ms busy, then 50 ms idle (and a little Python): just under half of each period.
    assert device["value"].between(30, 61).all(), device["value"].tolist()
    # All the work was the target's: over one driver period its share is the device's.
    one = mine[mine["dur_ns"] == 167 * MS].merge(device, on="ts_ns", suffixes=("", "_device"))
    assert len(one) >= 1 and (one["value"] == one["value_device"]).all()
    report = subprocess.run([str(trainbpf_cli()), "analyze", str(out), "--format", "json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["gpu"]["source"] == "nvml"
