"""GPU utilisation sampling: NVML when it answers (tracer/samplers/nvml.py: the driver's own
timestamped samples, and each process's share), else `nvidia-smi -lms`.

NVML and nvidia-smi stamp samples with the wall clock; each is converted to the trace
clock (CLOCK_MONOTONIC) with the offset measured when it is read (tracer/samplers/clock.py)."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import threading

import numpy as np
import pyarrow as pa

from trainbpf.trace.errors import EnvironmentCheckError
from trainbpf.trace.spool import make_batch
from trainbpf.tracer.samplers.clock import wall_minus_mono_ns
from trainbpf.tracer.samplers.nvml import NvmlSource

QUERY = "timestamp,index,uuid,pci.bus_id,utilization.gpu,utilization.memory,memory.used"
APPS_QUERY = "pid,gpu_uuid"
APPS_TIMEOUT_S = 10


def parse_smi_line(line: str, wall_minus_mono_ns: int) -> tuple | None:
    """One nvidia-smi CSV line -> (mono_ns, index, uuid, bus_id, util, mem_util, mem_mib).

    Lines that are not samples (errors, '[N/A]' fields) give None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 7:
        return None
    try:
        wall = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")  # local time
        wall_ns = int(wall.timestamp() * 1e9)  # naive datetime -> local time zone
        return (
            wall_ns - wall_minus_mono_ns,
            int(parts[1]),
            parts[2],
            parts[3],
            float(parts[4]),
            float(parts[5]),
            float(parts[6]),
        )
    except ValueError:
        return None


def samples_batch(samples: list[tuple]) -> pa.RecordBatch:
    """Rows (mono_ns, index, uuid, bus_id, util, mem_util, mem_mib[, dur_ns, pid]) ->
    `gpu` rows; dur_ns and pid (None where unknown / for a device sample) come from
    NVML only."""
    cols = list(zip(*(s + (None, None)[: 9 - len(s)] for s in samples))) if samples else [[]] * 9
    return make_batch(
        "gpu",
        {
            "ts_ns": np.array(cols[0], dtype=np.int64),
            "index": np.array(cols[1], dtype=np.int32),
            "uuid": list(cols[2]),
            "util_pct": np.array(cols[4], dtype=np.float64),
            "mem_util_pct": _ints(cols[5]),
            "mem_used_mib": _ints(cols[6]),
            "dur_ns": _ints(cols[7]),
            "pid": _ints(cols[8]),
        },
    )


def _ints(values) -> list:
    """Whole numbers with None kept (null in the trace)."""
    return [None if v is None else int(round(v)) for v in values]


class GpuSampler:
    """Samples every GPU every `interval_ms` in a background thread."""

    def __init__(self, *, mode: str, interval_ms: int = 100, smi: str = "nvidia-smi"):
        self.mode = mode  # auto | nvml | nvidia-smi | off
        self.interval_ms = interval_ms
        self.smi = smi
        self.source: str | None = None
        self.gpus: list[dict] = []  # index, uuid, bus_id
        self.count = 0  # device rows taken
        self.process_count = 0  # per-process rows taken (NVML)
        self._nvml: NvmlSource | None = None
        self._samples: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._smi_exe: str | None = None  # the nvidia-smi that answers, once started
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Before anything is compiled: `--gpu nvml` needs NVML (libnvidia-ml) to load."""
        if self.mode != "nvml":
            return
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            raise EnvironmentCheckError("--gpu nvml: the NVML bindings (nvidia-ml-py) are not installed; "
                                        "use --gpu nvidia-smi, auto or off") from None
        try:
            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
        except Exception as exc:
            raise EnvironmentCheckError(f"--gpu nvml: NVML cannot be loaded ({exc}); is the NVIDIA driver "
                                        "(libnvidia-ml.so.1) installed? Use --gpu nvidia-smi, auto or off") from None

    def start(self) -> None:
        if self.mode == "off":
            return
        if self.mode in ("auto", "nvml") and self._start_nvml():
            return
        if self.mode in ("auto", "nvidia-smi"):
            self._start_smi()

    def _start_nvml(self) -> bool:
        nvml = NvmlSource()
        if not nvml.open():
            return False
        self._nvml = nvml
        self.gpus = list(nvml.gpus)
        self.source = "nvml"

        def loop() -> None:
            while not self._stop.wait(self.interval_ms / 1000):
                for row in nvml.poll():
                    self._add(row)

        self._thread = threading.Thread(target=loop, name="trainbpf-gpu", daemon=True)
        self._thread.start()
        return True

    def _start_smi(self) -> None:
        exe = shutil.which(self.smi)
        if exe is None:
            return
        try:
            self._proc = subprocess.Popen(
                [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
            )
        except OSError:
            return
        self.source = "nvidia-smi"
        self._smi_exe = exe

        def reader() -> None:
            assert self._proc and self._proc.stdout
            for line in self._proc.stdout:
                # read now: the line was stamped a moment ago, and the wall clock may
                # have been stepped since the start
                sample = parse_smi_line(line, wall_minus_mono_ns())
                if sample is None:
                    continue
                if not any(g["index"] == sample[1] for g in self.gpus):
                    self.gpus.append({"index": sample[1], "uuid": sample[2], "bus_id": sample[3]})
                self._add(sample)

        self._thread = threading.Thread(target=reader, name="trainbpf-gpu", daemon=True)
        self._thread.start()
        self._first.wait(timeout=1.5)  # the first lines name the GPUs for the topology

    def meta(self) -> dict:
        """What the trace metadata says about the sampling (the counts are added at the
        stop)."""
        nvml = self._nvml
        return {
            "source": self.source,
            # driver_samples: one row per driver sample, with its own time and period;
            # rates: the driver's running average read at each poll (nvidia-smi too).
            "sampling": nvml.sampling if nvml else ("rates" if self.source else None),
            "sample_period_ns": nvml.period_ns if nvml else None,
        }

    def processes(self, pids: set[int]) -> list[dict]:
        """Which GPUs the processes `pids` hold a context on: [{pid, uuid}] (the compute
        processes NVML or nvidia-smi list, as the driver sees their pids).  Empty when
        nothing is known; never raises."""
        found: set[tuple[int, str]] = set()
        if self._nvml is not None:
            found = self._nvml.processes()
        elif self._smi_exe is not None:
            try:
                out = subprocess.run([self._smi_exe, f"--query-compute-apps={APPS_QUERY}", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=APPS_TIMEOUT_S, stdin=subprocess.DEVNULL)
                lines = out.stdout.splitlines() if out.returncode == 0 else []
            except (OSError, subprocess.SubprocessError):
                lines = []
            for line in lines:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 2 and parts[0].isdigit():
                    found.add((int(parts[0]), parts[1]))
        return [{"pid": pid, "uuid": uuid} for pid, uuid in sorted(found) if pid in pids]

    def _add(self, sample: tuple) -> None:
        with self._lock:
            self._samples.append(sample)
        self._first.set()

    def take(self) -> pa.RecordBatch | None:
        """The rows since the last take; the counts are of rows taken, so that they
        match the trace however late the sampler thread stops."""
        with self._lock:
            samples, self._samples = self._samples, []
        procs = sum(1 for s in samples if len(s) > 8 and s[8] is not None)
        self.process_count += procs
        self.count += len(samples) - procs
        return samples_batch(samples) if samples else None

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._nvml is not None and not (self._thread and self._thread.is_alive()):
            self._nvml.close()
