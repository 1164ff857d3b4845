"""Collector for probes/cuda.bpf.c: CUDA runtime/driver launches (counted), waits,
copies and allocations (streamed), from uprobes on the libcudart/libcuda files the
traced processes map (found and attached as tracer/libprobe.py finds them)."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import array_values, bucket_batches, drain_hash, stack_ids
from trainbpf.tracer.libprobe import LibraryCalls, LibraryCollector
from trainbpf.tracer.symbols.maps import Mapping

LAYERS = ("runtime", "driver")
# "event": an event's record or query, or a stream's wait on one (cudaStreamWaitEvent
# enqueues the wait; the host does not block): streamed whatever their duration, as a
# not-ready query returns at once.
KINDS = ("launch", "wait", "copy", "alloc", "free", "event")


class CudaCall(NamedTuple):
    """One probed call.  `arg`, `bytes` and `src` are the positions (from 1; 0: none) of
    its stream (event for event waits and event calls, pointer for frees; for allocations
    the argument the call writes the new pointer to, read at its return), byte-count and
    source pointer (copies) arguments; `stream` that of the stream an event call records
    on or makes wait."""

    name: str
    layer: int  # index into LAYERS
    kind: int  # index into KINDS
    arg: int
    bytes: int
    stream: int = 0
    src: int = 0


# The calls probed, declared only here; the position is the call code.  The probe compiles
# an entry and a return program for each from the CUDA_CALLS define (call_list()).
# Launches read no argument (they are only counted; cuLaunchKernel's stream is the 9th).
CALLS: tuple[CudaCall, ...] = tuple(CudaCall(*call) for call in (
    ("cudaLaunchKernel", 0, 0, 0, 0), ("cudaLaunchKernelExC", 0, 0, 0, 0),
    ("cudaLaunchCooperativeKernel", 0, 0, 0, 0), ("cudaGraphLaunch", 0, 0, 0, 0),
    ("cudaStreamSynchronize", 0, 1, 1, 0), ("cudaDeviceSynchronize", 0, 1, 0, 0),
    ("cudaEventSynchronize", 0, 1, 1, 0), ("cudaMemcpy", 0, 2, 0, 3, 0, 2), ("cudaMemcpyAsync", 0, 2, 5, 3, 0, 2),
    ("cudaMalloc", 0, 3, 1, 2), ("cudaFree", 0, 4, 1, 0),
    ("cuLaunchKernel", 1, 0, 0, 0), ("cuLaunchKernelEx", 1, 0, 0, 0), ("cuGraphLaunch", 1, 0, 0, 0),
    ("cuStreamSynchronize", 1, 1, 1, 0), ("cuCtxSynchronize", 1, 1, 0, 0), ("cuEventSynchronize", 1, 1, 1, 0),
    # Copies: (dst, src, bytes[, ..., stream]); the source pointer is the second argument.
    ("cuMemcpy", 1, 2, 0, 3, 0, 2), ("cuMemcpyAsync", 1, 2, 4, 3, 0, 2), ("cuMemcpyHtoD", 1, 2, 0, 3, 0, 2),
    ("cuMemcpyHtoDAsync", 1, 2, 4, 3, 0, 2), ("cuMemcpyDtoH", 1, 2, 0, 3, 0, 2), ("cuMemcpyDtoHAsync", 1, 2, 4, 3, 0, 2),
    ("cuMemcpyDtoD", 1, 2, 0, 3, 0, 2), ("cuMemcpyDtoDAsync", 1, 2, 4, 3, 0, 2),
    ("cuMemAlloc", 1, 3, 1, 2), ("cuMemAllocAsync", 1, 3, 1, 2), ("cuMemAllocHost", 1, 3, 1, 2),
    ("cuMemAllocManaged", 1, 3, 1, 2),
    ("cuMemFree", 1, 4, 1, 0), ("cuMemFreeHost", 1, 4, 1, 0), ("cuMemFreeAsync", 1, 4, 1, 0),
    # Pinned host memory and stream-ordered allocations.
    ("cudaHostAlloc", 0, 3, 1, 2), ("cudaMallocHost", 0, 3, 1, 2), ("cudaMallocAsync", 0, 3, 1, 2),
    ("cudaFreeHost", 0, 4, 1, 0), ("cudaFreeAsync", 0, 4, 1, 0), ("cuMemHostAlloc", 1, 3, 1, 2),
    # Events: what a free waits on (a not-ready query, a stream made to wait).
    ("cudaEventQuery", 0, 5, 1, 0), ("cuEventQuery", 1, 5, 1, 0),
    ("cudaStreamWaitEvent", 0, 5, 2, 0, 1), ("cuStreamWaitEvent", 1, 5, 2, 0, 1),
    ("cudaEventRecord", 0, 5, 1, 0, 2), ("cuEventRecord", 1, 5, 1, 0, 2),
))
# The slots of a thread's current bucket in the probe (cuda_thread): (name, layer, nested).
LAUNCH_SLOTS = (("runtime", 0, 0), ("driver", 1, 0), ("nested", 1, 1))
# Finished (thread, bucket, layer, nesting) launch counts the probe's hash holds between two
# drains: a hundred 10 ms buckets a second in three slots for each of ~200 launching threads.
LAUNCH_ENTRIES = 65536
CALL_INDEX = {call.name: i for i, call in enumerate(CALLS)}
# A base name and any exported versioned aliases of it.
SYMBOL_RE = r"^(" + "|".join(call.name for call in CALLS) + r")((_v2|_v3)?(_ptsz|_ptds)?)$"
LIBRARY_RE = re.compile(r"/lib(cudart|cuda)\.so(\.\d+)*$")
CUDA_LIBRARIES = LibraryCalls(LIBRARY_RE, "/libcud", SYMBOL_RE)
# Copies whose source is device memory by the call's name: their pages are not asked about.
DEVICE_SOURCE_CALLS = frozenset(c.name for c in CALLS if "DtoH" in c.name or "DtoD" in c.name)


def call_list() -> str:
    """CALLS as the probe's CUDA_CALLS define: CALL(symbol,code,layer,kind,arg,bytes,stream,src) for each."""
    return "".join(f"CALL({c.name},{code},{c.layer},{c.kind},{c.arg},{c.bytes},{c.stream},{c.src})"
                   for code, c in enumerate(CALLS))


def nest_jiffies(hz: int) -> int:
    """Kernel ticks a runtime launch's mark waits for the driver launch it makes (the
    probe's CUDA_NEST_JIFFIES): a tenth of a second, as the thread can be preempted
    between the two probes (4 ms was seen too short) and a preemption is no new launch."""
    return max(1, hz // 10)


def base_name(symbol: str) -> str | None:
    return CUDA_LIBRARIES.base_name(symbol)


def cuda_mappings(maps_text: str) -> list[Mapping]:
    """The first mapping of each libcudart/libcuda file (device, inode) mapped."""
    return CUDA_LIBRARIES.mappings(maps_text)


def cuda_libraries(maps_text: str) -> list[tuple[str, tuple[str, int]]]:
    """(path, (device, inode)) of each libcudart/libcuda mapped, once each."""
    return [(m.path, m.file) for m in cuda_mappings(maps_text)]


def thread_buckets(records: np.ndarray, width: int) -> list[tuple]:
    """The bucket each thread is counting (probes/cuda.bpf.c cuda_threads: its records,
    owner 0 for a record never used) as cuda_launches rows: (bucket, tid, pid, launches,
    first_ns, layer, nested) for each slot with launches.  A bucket is moved out of its
    record only when the thread launches in a later one, so the last is read here, at
    the stop."""
    rows = []
    used = records[records["tid"] != 0]
    for end_ns, tid, pid, launches, first_ns in zip(*(used[f].tolist() for f in (
            "end_ns", "tid", "pid", "launches", "first_ns"))):
        for slot, (_, layer, nested) in enumerate(LAUNCH_SLOTS):
            if launches[slot]:
                rows.append((end_ns // width - 1, tid, pid, launches[slot], first_ns[slot], layer, nested))
    return rows


def exported_calls(path: str) -> list[tuple[str, str]]:
    """(symbol, base name) of the probed calls a CUDA library exports, one per address."""
    return CUDA_LIBRARIES.exported(path)


class CudaCollector(LibraryCollector):
    name = "cuda"
    source = "cuda.bpf.c"
    ringbufs = ("cuda_events",)
    calls = CUDA_LIBRARIES

    def defines(self) -> dict[str, int | str]:
        return {"CUDA_NEST_JIFFIES": nest_jiffies(self.settings.hz), "CUDA_LAUNCH_ENTRIES": LAUNCH_ENTRIES,
                **{f"LAYER_{layer.upper()}": i for i, layer in enumerate(LAYERS)},
                **{f"CUDA_{kind.upper()}": i for i, kind in enumerate(KINDS)},
                "CUDA_CALLS": call_list(), "CUDA_SLOTS": len(LAUNCH_SLOTS),
                **{f"CUDA_SLOT_{name.upper()}": i for i, (name, _, _) in enumerate(LAUNCH_SLOTS)}}

    def attach_call(self, bpf, opened: str, sym: str, base: str) -> None:
        bpf.attach_uprobe(name=opened, sym=sym, fn_name=f"enter_{base}")
        if KINDS[CALLS[CALL_INDEX[base]].kind] != "launch":  # launches are only counted, at entry
            bpf.attach_uretprobe(name=opened, sym=sym, fn_name=f"return_{base}")

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        names = [CALLS[c].name for c in r["name"].tolist()]
        kinds = [KINDS[CALLS[c].kind] for c in r["name"].tolist()]
        return [
            make_batch(
                "cuda_call",
                {
                    "ts_ns": r["ts_ns"].astype(np.int64),
                    "dur_ns": r["dur_ns"].astype(np.int64),
                    "tid": r["tid"].astype(np.int32),
                    "pid": r["pid"].astype(np.int32),
                    "name": names,
                    "state": kinds,
                    "nested": r["nested"].astype(np.int32),
                    "addr": r["addr"],
                    "bytes": r["bytes"].astype(np.int64),
                    "ret": r["ret"].astype(np.int64),
                    "stream": r["stream"].astype(np.int64),
                    "ustack_id": stack_ids(r["ustack_id"]),
                    "src": r["src"].astype(np.int64),  # user addresses stay below 2**63
                },
            )
        ]

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        super().drain(bpf, now_ns, final=final)  # libraries mapped since
        if not self.libraries:  # nothing probed, nothing counted: a drain walks 65,536 buckets (~0.2 ms)
            return []
        keys, launches = drain_hash(bpf["cuda_launches"])
        counts = list(zip(*(a.tolist() for a in (keys["bucket"], keys["tid"], keys["pid"], launches["launches"],
                                                  launches["first_ns"], keys["layer"], keys["nested"]))))
        if final:  # each thread's last bucket, still in its record
            counts += thread_buckets(array_values(bpf["cuda_threads"]), self.settings.cuda_bucket_ns)
        return bucket_batches("cuda_launch", counts, self.settings.cuda_bucket_ns, counted="launches", first_ns=True,
                              extra={"layer": lambda layer: [LAYERS[x] for x in layer.tolist()],
                                     "nested": lambda nested: nested.astype(np.int32)})
