"""What a recording can be told, each default declared once: the probes' thresholds and
sizes (each becomes a -D define) and the GPU sampling modes.  Light to import: the CLI
reads its option defaults from here."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
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
    "cuda_thread_records": Limit(1, 1 << 20, power_of_two=True),
    "stack_frames": Limit(1, 127),  # PERF_MAX_STACK_DEPTH
    "stack_entries": Limit(1, 1 << 20),
    "hz": Limit(1, 10_000),
}


@dataclass(frozen=True)
class Settings:
    """Recording thresholds and sizes; each becomes a -D define for the probes."""

    min_block_ns: int = 20_000
    min_futex_ns: int = 20_000
    min_lock_ns: int = 10_000
    oncpu_hz: int = 199
    fault_bucket_ns: int = 100_000_000
    min_cuda_ns: int = 20_000  # CUDA waits, copies and allocations streamed from this long
    cuda_bucket_ns: int = 10_000_000  # CUDA launches counted per thread and bucket this wide
    cuda_thread_records: int = 16384  # launching threads' current buckets, at tid % this (a power of two)
    ringbuf_pages: int = 512
    stack_frames: int = 32  # frames kept per stack: the kernel walks no deeper (probes/common.h)
    stack_entries: int = 65536  # stacks the kernel's stack map holds
    hz: int = 250
    trace_all: bool = False
    python_frames: bool = True  # walk CPython frames where user stacks are taken (probes/pyframes.h)
    exec_leaves: bool = False  # under sudo: an exec takes a process out of the traced set (tracer/access.py)

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
        return {
            "min_block_ns": self.min_block_ns,
            "min_futex_ns": self.min_futex_ns,
            "min_lock_ns": self.min_lock_ns,
            "oncpu_hz": self.oncpu_hz,
            "fault_bucket_ns": self.fault_bucket_ns,
            "min_cuda_ns": self.min_cuda_ns,
            "cuda_bucket_ns": self.cuda_bucket_ns,
            "cuda_thread_records": self.cuda_thread_records,
            "ringbuf_pages": self.ringbuf_pages,
            "stack_frames": self.stack_frames,
            "stack_entries": self.stack_entries,
            "hz": self.hz,
        }
