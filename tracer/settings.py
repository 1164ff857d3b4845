"""What a recording can be told, each default declared once: the probes' thresholds and
sizes (each becomes a -D define) and the GPU sampling modes.  Light to import: the CLI
reads its option defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

# How the recorder samples GPUs (trainbpf.tracer.gpu): auto = NVML, else nvidia-smi.
GPU_MODES = ("auto", "nvml", "nvidia-smi", "off")


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
