"""The collector side of a probe: which BPF source it is, what it needs from the kernel,
and how its raw ring-buffer records become trace rows.

Records are copied out of the ring buffer as raw bytes and decoded in batches with numpy,
using a dtype built from the event struct that bcc parsed out of the C source (the C
struct is the only declaration).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import pyarrow as pa

# Index of each probe's lost-event counter in the BPF `lost` array (probes/common.h).
PROBE_IDS = {
    "sched": 0,
    "task": 1,
    "futex": 2,
    "faults": 3,
    "oncpu": 4,
    "mm": 5,
    "writeback": 6,
    "block": 7,
    "cuda": 8,
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
    ringbuf_pages: int = 512
    stack_frames: int = 32  # frames kept per stack: the kernel walks no deeper (probes/common.h)
    stack_entries: int = 65536  # stacks the kernel's stack map holds
    hz: int = 250
    trace_all: bool = False

    def thresholds(self) -> dict[str, int]:
        return {
            "min_block_ns": self.min_block_ns,
            "min_futex_ns": self.min_futex_ns,
            "min_lock_ns": self.min_lock_ns,
            "oncpu_hz": self.oncpu_hz,
            "fault_bucket_ns": self.fault_bucket_ns,
            "min_cuda_ns": self.min_cuda_ns,
            "cuda_bucket_ns": self.cuda_bucket_ns,
            "ringbuf_pages": self.ringbuf_pages,
            "stack_frames": self.stack_frames,
            "stack_entries": self.stack_entries,
            "hz": self.hz,
        }


def ctypes_to_dtype(cls: type[ctypes.Structure]) -> np.dtype:
    """numpy dtype with the exact layout of a bcc-generated event class."""
    dtype = np.dtype(cls)
    if dtype.itemsize != ctypes.sizeof(cls):
        raise AssertionError(f"{cls.__name__}: dtype {dtype.itemsize} != C {ctypes.sizeof(cls)}")
    return dtype


def cstrings(arr: np.ndarray) -> list[str]:
    """Fixed-size C char arrays to str, cut at the first NUL.  bcc's ctypes classes make
    char[N] an (N,) array of S1, which we view as one SN string per record."""
    if arr.ndim == 2:
        arr = np.ascontiguousarray(arr).view(f"S{arr.shape[1]}").reshape(-1)
    return [b.split(b"\0", 1)[0].decode(errors="replace") for b in arr.tolist()]


def stack_ids(arr: np.ndarray) -> np.ndarray:
    """Stack ids with failures (negative errno) as -1."""
    return np.where(arr >= 0, arr, -1).astype(np.int32)


class Collector:
    """Base class: one probe's source, requirements and decoding."""

    name: ClassVar[str]
    source: ClassVar[str]  # file under probes/
    tracepoints: ClassVar[tuple[str, ...]] = ()  # "category:event" the probe needs
    optional_tracepoints: ClassVar[tuple[str, ...]] = ()  # compiled in when present
    # Bare tracepoints (no tracefs entry), attached as raw tracepoints when present.
    optional_raw_tracepoints: ClassVar[tuple[str, ...]] = ()
    ringbufs: ClassVar[tuple[str, ...]] = ()
    uprobes: ClassVar[bool] = False  # attaches uprobes (to libraries found while recording), no tracepoints
    lost_names: ClassVar[tuple[str, ...]] = ()  # keys of PROBE_IDS this probe counts
    notice: Callable[[str], None] | None = None  # one-line news for the user (record sets it)

    def __init__(self, settings: Settings):
        self.settings = settings

    def defines(self) -> dict[str, int]:
        return {}

    def attach(self, bpf) -> None:
        """Attach what bcc does not attach by itself (tracepoints attach on load)."""

    def decode(self, ringbuf: str, records: np.ndarray) -> list[pa.RecordBatch]:
        raise NotImplementedError

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        """Read and reset in-kernel aggregates; `final` at the end of the recording."""
        return []

    def seeded(self, bpf, tgids: list[int]) -> None:
        """The traced processes at the start, once the tree is seeded."""

    def meta(self) -> dict:
        """What the probe adds to the trace metadata when the recording ends."""
        return {}


def drain_hash(table) -> list[tuple]:
    """Every (key, value) of a BPF hash, deleting what was read.

    Batch lookup-and-delete is atomic per entry, so nothing counted between the read and
    the delete is lost."""
    try:
        return list(table.items_lookup_and_delete_batch())
    except Exception:  # kernels or maps without batch ops: read then delete per key
        items = list(table.items())
        for key, _ in items:
            try:
                del table[key]
            except KeyError:
                pass
        return items
