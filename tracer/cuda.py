"""Collector for probes/cuda.bpf.c: CUDA runtime/driver launches (counted), waits,
copies and allocations (streamed), from uprobes on the libraries the traced processes map.

Libraries are found in /proc/PID/maps (pip wheels put them under
site-packages/nvidia/*/lib), rescanned at every flush: torch loads CUDA lazily.  Each is
probed through the file mapped itself (addrs.open_mapped: /proc/PID/map_files), never
by the name the process saw, which its owner may have pointed at another file since
(docs/security.md); a container's copy is so the one probed too.  A uprobe on a file
fires in every process mapping it, forked workers included, so each library file
(device, inode) is attached once."""

from __future__ import annotations

import os
import re

import numpy as np
import pyarrow as pa

from trainbpf.tracefile import make_batch
from trainbpf.tracer.addrs import FUNCTION_KINDS, ElfSymbols, Mapping, open_mapped, parse_maps
from trainbpf.tracer.collector import Collector, ThreadTable, array_values, bucket_batches, drain_hash, stack_ids

LAYERS = ("runtime", "driver")
KINDS = ("launch", "wait", "copy", "alloc", "free")
# (symbol, layer, kind); the position is the call code.  The probe compiles an entry and a
# return program for each (CUDA_CALLS, call_list()).
CALLS: tuple[tuple[str, int, int], ...] = (
    ("cudaLaunchKernel", 0, 0), ("cudaLaunchKernelExC", 0, 0), ("cudaLaunchCooperativeKernel", 0, 0),
    ("cudaGraphLaunch", 0, 0), ("cudaStreamSynchronize", 0, 1), ("cudaDeviceSynchronize", 0, 1),
    ("cudaEventSynchronize", 0, 1), ("cudaMemcpy", 0, 2), ("cudaMemcpyAsync", 0, 2), ("cudaMalloc", 0, 3),
    ("cudaFree", 0, 4),
    ("cuLaunchKernel", 1, 0), ("cuLaunchKernelEx", 1, 0), ("cuGraphLaunch", 1, 0),
    ("cuStreamSynchronize", 1, 1), ("cuCtxSynchronize", 1, 1), ("cuEventSynchronize", 1, 1),
    ("cuMemcpy", 1, 2), ("cuMemcpyAsync", 1, 2), ("cuMemcpyHtoD", 1, 2), ("cuMemcpyHtoDAsync", 1, 2),
    ("cuMemcpyDtoH", 1, 2), ("cuMemcpyDtoHAsync", 1, 2), ("cuMemcpyDtoD", 1, 2), ("cuMemcpyDtoDAsync", 1, 2),
    ("cuMemAlloc", 1, 3), ("cuMemAllocAsync", 1, 3), ("cuMemAllocHost", 1, 3), ("cuMemAllocManaged", 1, 3),
    ("cuMemFree", 1, 4), ("cuMemFreeHost", 1, 4), ("cuMemFreeAsync", 1, 4),
)
# The slots of a thread's current bucket in the probe (cuda_thread): (name, layer, nested).
LAUNCH_SLOTS = (("runtime", 0, 0), ("driver", 1, 0), ("nested", 1, 1))
CALL_INDEX = {name: i for i, (name, _, _) in enumerate(CALLS)}
# A base name and any exported versioned aliases of it.
SYMBOL_RE = r"^(" + "|".join(n for n, _, _ in CALLS) + r")((_v2|_v3)?(_ptsz|_ptds)?)$"
LIBRARY_RE = re.compile(r"/lib(cudart|cuda)\.so(\.\d+)*$")


def call_list() -> str:
    """CALLS as the probe's CUDA_CALLS define: CALL(symbol,code,layer,kind) for each."""
    return "".join(f"CALL({name},{code},{layer},{kind})" for code, (name, layer, kind) in enumerate(CALLS))


def base_name(symbol: str) -> str | None:
    m = re.match(SYMBOL_RE, symbol)
    return m.group(1) if m else None


def cuda_mappings(maps_text: str) -> list[Mapping]:
    """The first mapping of each libcudart/libcuda file (device, inode) mapped."""
    seen: dict[tuple[str, int], Mapping] = {}
    for m in parse_maps(maps_text):
        if LIBRARY_RE.search(m.path):
            seen.setdefault(m.file, m)
    return list(seen.values())


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


def _mapped_size(pid: int) -> bytes:
    """The total size of a process's mappings (/proc/PID/statm's first field)."""
    fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
    try:
        return os.read(fd, 128).split(b" ", 1)[0]
    finally:
        os.close(fd)


def exported_calls(path: str) -> list[tuple[str, str]]:
    """(symbol, base name) of the probed calls a library exports, one per address: an
    alias at the address of another symbol would count every call twice.  The symbols
    are read as bcc reads them (both tables); a malformed file raises ValueError."""
    by_addr: dict[int, str] = {}
    for sym, addr in ElfSymbols(path, FUNCTION_KINDS, every_table=True).named(SYMBOL_RE):
        if addr not in by_addr or len(sym) < len(by_addr[addr]):  # the base name wins
            by_addr[addr] = sym
    return sorted((sym, base_name(sym)) for sym in by_addr.values())


class CudaCollector(Collector):
    name = "cuda"
    source = "cuda.bpf.c"
    ringbufs = ("cuda_events",)
    uprobes = True

    def __init__(self, settings):
        super().__init__(settings)
        self.libraries: dict[tuple[str, int], dict] = {}  # (device, inode) -> metadata
        self._size_seen: dict[int, bytes] = {}  # pid -> its mappings' total size when last scanned
        self._pids: set[int] = set()
        self._held: list[int] = []  # descriptors of the files probed, whose /proc/self/fd names the probes hold
        self.threads = ThreadTable()  # the recorder's, from seeded()

    def defines(self) -> dict[str, int | str]:
        return {"MIN_CUDA_NS": self.settings.min_cuda_ns, "CUDA_BUCKET_NS": self.settings.cuda_bucket_ns,
                "CUDA_THREAD_RECORDS": self.settings.cuda_thread_records,
                # a runtime launch's mark waits this many ticks for its driver launch: the
                # thread can be preempted between the two probes (4 ms was seen too short)
                "CUDA_NEST_JIFFIES": max(1, self.settings.hz // 10),
                **{f"LAYER_{layer.upper()}": i for i, layer in enumerate(LAYERS)},
                **{f"CUDA_{kind.upper()}": i for i, kind in enumerate(KINDS)},
                "CUDA_CALLS": call_list(), "CUDA_SLOTS": len(LAUNCH_SLOTS),
                **{f"CUDA_SLOT_{name.upper()}": i for i, (name, _, _) in enumerate(LAUNCH_SLOTS)}}

    def seeded(self, bpf, walked, threads, now_ns: int) -> None:
        self.threads = threads
        self.scan(bpf)

    def scan(self, bpf) -> None:
        """Attach to CUDA libraries newly mapped by traced processes."""
        # The recorder's table, which learns of new processes at each flush.
        self._pids.update(self.threads.live().values())
        for pid in sorted(self._pids):
            try:
                # A library mapped since changes the total size, and reading it costs
                # ~20 us where the maps cost ~0.5 ms a process (docs/performance.md).
                # Unless something else unmapped exactly as much meanwhile: then the
                # library is found at the next change of size.
                size = _mapped_size(pid)
                if self._size_seen.get(pid) == size:
                    continue
                with open(f"/proc/{pid}/maps") as fh:
                    text = fh.read()
            except OSError:
                self._pids.discard(pid)
                self._size_seen.pop(pid, None)
                continue
            self._size_seen[pid] = size
            if "/libcud" not in text:  # most processes: no need to parse
                continue
            for m in cuda_mappings(text):
                if m.file not in self.libraries:
                    self._attach(bpf, pid, m)
                lib = self.libraries[m.file]
                if pid not in lib["pids"]:
                    lib["pids"].append(pid)

    def _attach(self, bpf, pid: int, m: Mapping) -> None:
        """Probe the file `m` maps, through a descriptor of it: the kernel resolves
        /proc/self/fd/N to that very inode, and no one can repoint the name."""
        probed, failed, why = [], [], ""
        try:
            fd = open_mapped(pid, m)
        except OSError as exc:
            calls, why = [], f"not opened: {exc.strerror or exc}"
        else:
            self._held.append(fd)
            opened = f"/proc/self/fd/{fd}"
            try:
                calls = exported_calls(opened)
            except (OSError, ValueError) as exc:  # unreadable, or a malformed ELF file
                calls, why = [], f"not read: {exc}"
        for sym, base in calls:
            kind = CALLS[CALL_INDEX[base]][2]
            try:
                bpf.attach_uprobe(name=opened, sym=sym, fn_name=f"enter_{base}")
                if KINDS[kind] != "launch":  # launches are only counted, at entry
                    bpf.attach_uretprobe(name=opened, sym=sym, fn_name=f"return_{base}")
                probed.append(sym)
            except Exception:  # bcc raises bare Exception
                failed.append(sym)
        self.libraries[m.file] = {"path": m.path, "device": m.file[0], "inode": m.file[1], "symbols": probed,
                                  "failed": failed, "pids": [], **({"error": why} if why else {})}
        if self.notice:
            self.notice(f"cuda: probing {len(probed)} symbols in {m.path} (process {pid})"
                        + (f", {len(failed)} failed" if failed else "") + (f"; {why}" if why else ""))

    def close(self) -> None:
        for fd in self._held:
            os.close(fd)
        self._held.clear()

    def meta(self) -> dict:
        return {"cuda": {"libraries": list(self.libraries.values())}}

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        names = [CALLS[c][0] for c in r["call"].tolist()]
        kinds = [KINDS[CALLS[c][2]] for c in r["call"].tolist()]
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
                    "op": r["nested"].astype(np.int32),
                    "addr": r["arg"],
                    "size": r["bytes"].astype(np.int64),
                    "count": r["ret"].astype(np.int64),
                    "ustack_id": stack_ids(r["ustack_id"]),
                },
            )
        ]

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        if not final:
            self.scan(bpf)
        keys, launches = drain_hash(bpf["cuda_launches"])
        counts = list(zip(*(a.tolist() for a in (keys["bucket"], keys["tid"], keys["pid"], launches["launches"],
                                                  launches["first_ns"], keys["layer"], keys["nested"]))))
        if final:  # each thread's last bucket, still in its record
            counts += thread_buckets(array_values(bpf["cuda_threads"]), self.settings.cuda_bucket_ns)
        return bucket_batches("cuda_launch", counts, self.settings.cuda_bucket_ns, first_ns=True, extra={
            "name": lambda layer: [LAYERS[x] for x in layer.tolist()],
            "op": lambda nested: nested.astype(np.int32),
        })
