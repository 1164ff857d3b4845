"""What a recording can be told, each default declared once: the probes' thresholds and
sizes (those the probes take reach them as -D defines, Settings.defines) and the GPU
sampling modes.  Light to import: the CLI reads its option defaults from here."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from trainbpf.trace.errors import UsageError

# How the recorder samples GPUs (trainbpf.tracer.samplers.gpu): auto = NVML, else nvidia-smi.
GPU_MODES = ("auto", "nvml", "nvidia-smi", "off")


@dataclass(frozen=True)
class Limit:
    """The values a setting takes, checked when Settings is made: a value outside them
    would fail only as the probes compile or attach ("loading the probes failed")."""

    low: int
    high: int
    option: str = ""  # the `record` option that sets it, in its own unit
    scale: int = 1  # the setting's units per unit of the option (1000: ns per us)
    unit: str = ""
    power_of_two: bool = False

    def check(self, name: str, value: Any) -> None:
        """Raise a UsageError naming the option (or `name`) and the accepted range."""
        if isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high \
                and not (self.power_of_two and value & (value - 1)):
            return
        self.refuse(self.option or name, value / self.scale if _is_number(value) else value)

    def refuse(self, option: str, value: Any) -> NoReturn:
        accepted = f"{_shown(self.low / self.scale)} to {_shown(self.high / self.scale)}"
        raise UsageError(f"{option} {_shown(value)}: must be {'a power of two ' if self.power_of_two else ''}"
                         f"from {accepted}{' ' + self.unit if self.unit else ''}")

    def from_option(self, value: float) -> int:
        """The setting of an option's value (microseconds to nanoseconds), checked first:
        inf, NaN or 1e30 is refused, never converted."""
        if not (_is_number(value) and math.isfinite(value) and self.low <= value * self.scale <= self.high):
            self.refuse(self.option, value)
        return int(round(value * self.scale))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value as a user would type it: 3600000000, 0.5, 1e+30, 'x'."""
    if not _is_number(value):
        return repr(value)
    return str(int(value)) if math.isfinite(value) and value == int(value) and abs(value) < 1e15 else f"{value:g}"


MAX_THRESHOLD_NS = 3600 * 10**9  # an hour: no wait worth a threshold is longer
_US = dict(scale=1000, unit="microseconds")
LIMITS = {
    "min_block_ns": Limit(0, MAX_THRESHOLD_NS, "--min-block-us", **_US),
    "min_futex_ns": Limit(0, MAX_THRESHOLD_NS, "--min-futex-us", **_US),
    "min_lock_ns": Limit(0, MAX_THRESHOLD_NS, "--min-lock-us", **_US),
    "min_cuda_ns": Limit(0, MAX_THRESHOLD_NS, "--min-cuda-us", **_US),
    # perf's own ceiling is kernel.perf_event_max_sample_rate (100000 at most), which the
    # kernel lowers when sampling costs too much; 10 kHz per CPU is far past useful.
    "oncpu_hz": Limit(1, 10_000, "--oncpu-hz", unit="samples per second"),
    # 64 MiB per ring buffer (4 KiB pages), for each of the probes' dozen ring buffers.
    "ringbuf_pages": Limit(1, 16384, "--ringbuf-pages", unit="pages", power_of_two=True),
    "fault_bucket_ns": Limit(1, MAX_THRESHOLD_NS),
    "cuda_bucket_ns": Limit(1, MAX_THRESHOLD_NS),
    "refault_keys": Limit(1, 1 << 22),
    "cgroup_sample_ns": Limit(1_000_000, MAX_THRESHOLD_NS),
    "disk_bucket_ns": Limit(1_000_000, MAX_THRESHOLD_NS),  # a millisecond at least: buckets fill the kernel's hashes
    "net_bucket_ns": Limit(1_000_000, MAX_THRESHOLD_NS),  # as disk_bucket_ns
    "cuda_thread_records": Limit(1, 1 << 20, power_of_two=True),
    "stack_frames": Limit(1, 127),  # PERF_MAX_STACK_DEPTH
    "stack_entries": Limit(1, 1 << 20),
    "hz": Limit(1, 10_000),
}


def _number(default: int, define: str = "") -> Any:
    """A setting the trace's metadata records under `thresholds`; `define`: the -D name the
    probes take it by ("" where only the collector reads it)."""
    return field(default=default, metadata={"threshold": True, "define": define})


def _from_env(variable: str, default: int, define: str) -> Any:
    """A setting as _number, whose default the environment's `variable` may replace
    (checked against LIMITS as any value is)."""
    def read() -> Any:
        text = os.environ.get(variable, "").strip()
        if not text:
            return default
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"{variable} {text!r}: must be a whole number of nanoseconds") from None
    return field(default_factory=read, metadata={"threshold": True, "define": define})


def _switch(default: bool, define: str) -> Any:
    """An on/off setting the probes take as -D `define` (0 or 1)."""
    return field(default=default, metadata={"define": define})


@dataclass(frozen=True)
class Settings:
    """Recording thresholds and sizes; each the probes use becomes a -D define."""

    min_block_ns: int = _number(20_000, "MIN_BLOCK_NS")
    min_futex_ns: int = _number(20_000, "MIN_FUTEX_NS")
    min_lock_ns: int = _number(10_000, "MIN_LOCK_NS")
    oncpu_hz: int = _number(199)  # the perf event's sampling frequency
    fault_bucket_ns: int = _number(100_000_000)  # how often the collector reads fault counters
    min_cuda_ns: int = _number(20_000, "MIN_CUDA_NS")  # CUDA waits, copies and allocations streamed from this long
    cuda_bucket_ns: int = _number(10_000_000, "CUDA_BUCKET_NS")  # CUDA launches counted per thread and bucket this wide
    # launching threads' current buckets, at tid % this (a power of two)
    cuda_thread_records: int = _number(16384, "CUDA_THREAD_RECORDS")
    # dropped pages whose return counts as a refault, the least recently dropped forgotten first
    refault_keys: int = _number(131_072, "REFAULT_KEYS")
    # how often the traced processes' memory cgroups are read (tracer/samplers/memcg.py)
    cgroup_sample_ns: int = _number(500_000_000)
    # block requests, writeback, dirtied folios, traced threads' writes and page cache
    # changes counted per bucket this wide (disk, writeback, writepath, pagecache, tlb probes)
    disk_bucket_ns: int = _number(100_000_000, "DISK_BUCKET_NS")
    # traced threads' socket bytes and requests, retransmits and every interface's packets
    # counted per bucket this wide (net probe)
    net_bucket_ns: int = _from_env("TRAINBPF_NET_BUCKET_NS", 100_000_000, "NET_BUCKET_NS")
    ringbuf_pages: int = _number(512, "RINGBUF_PAGES")  # per probe's ring buffer
    # frames kept per stack: the kernel walks no deeper (probes/common.h)
    stack_frames: int = _number(32, "STACK_FRAMES")
    stack_entries: int = _number(65536, "STACK_ENTRIES")  # stacks the kernel's stack map holds
    hz: int = _number(250)  # the kernel's tick rate (CONFIG_HZ)
    trace_all: bool = _switch(False, "TRACE_ALL")  # every thread on the machine (node-wide health check)
    # walk CPython frames where user stacks are taken (probes/pyframes.h)
    python_frames: bool = _switch(True, "PYTHON_FRAMES")
    # under sudo: an exec takes a process out of the traced set (tracer/access.py)
    exec_leaves: bool = _switch(False, "EXEC_LEAVES")

    def __post_init__(self) -> None:
        for name, limit in LIMITS.items():
            limit.check(name, getattr(self, name))

    @classmethod
    def from_options(cls, **options: Any) -> "Settings":
        """Settings from `record`'s options as the user gives them (min_block_us=20.0,
        oncpu_hz=199, ...; LIMITS names them): each checked before it is converted."""
        by_option = {limit.option.lstrip("-").replace("-", "_"): name for name, limit in LIMITS.items() if limit.option}
        known = {f.name for f in fields(cls)}
        values = {}
        for key, value in options.items():
            if key in by_option:
                values[by_option[key]] = LIMITS[by_option[key]].from_option(value)
            elif key in known:
                values[key] = value
            else:
                raise TypeError(f"Settings.from_options: unknown option {key}")
        return cls(**values)

    def thresholds(self) -> dict[str, int]:
        """The numbers the trace's metadata records, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("threshold")}

    def defines(self) -> dict[str, int]:
        """The -D defines of the settings the probes take (booleans as 0 or 1)."""
        return {f.metadata["define"]: int(getattr(self, f.name)) for f in fields(self) if f.metadata.get("define")}
