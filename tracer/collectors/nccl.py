"""Collector for probes/nccl.bpf.c: every NCCL collective, point-to-point call and
ncclGroupEnd of the traced threads, entry to return, from uprobes on the libnccl files
the traced processes map (pip wheels' site-packages/nvidia/nccl/lib/libnccl.so.2
included; found and attached as tracer/libprobe.py finds them)."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import delete_keys
from trainbpf.tracer.libprobe import LibraryCalls, LibraryCollector



class NcclCall(NamedTuple):
    """One probed call: the positions (from 1; 0: none) of its ncclComm_t and element-count
    arguments (nccl.h; ncclReduce's comm, the 7th, is read from the stack)."""

    name: str
    comm: int
    elements: int


# The calls probed, declared only here; the position is the call code.  The probe compiles
# an entry and a return program for each from the NCCL_CALLS define (call_list()).
# ncclGroupEnd is where calls made between ncclGroupStart and it run (and wait).
CALLS: tuple[NcclCall, ...] = tuple(NcclCall(*call) for call in (
    ("ncclAllReduce", 6, 3), ("ncclBroadcast", 6, 3), ("ncclReduce", 7, 3), ("ncclAllGather", 5, 3),
    ("ncclReduceScatter", 6, 3), ("ncclSend", 5, 2), ("ncclRecv", 5, 2), ("ncclGroupEnd", 0, 0),
))
CALL_INDEX = {call.name: i for i, call in enumerate(CALLS)}
# A call, or its profiling alias pnccl* (the same function in NCCL's builds).
SYMBOL_RE = r"^p?(" + "|".join(CALL_INDEX) + r")$"
# libnccl.so, libnccl.so.2, libnccl.so.2.21.5; not plugins such as libnccl-net.so.
LIBRARY_RE = re.compile(r"/libnccl\.so(\.\d+)*$")
NCCL_LIBRARIES = LibraryCalls(LIBRARY_RE, "/libnccl", SYMBOL_RE)


def call_list() -> str:
    """CALLS as the probe's NCCL_CALLS define: NCCL_CALL(symbol,code,comm,elements) for each."""
    return "".join(f"NCCL_CALL({c.name},{code},{c.comm},{c.elements})" for code, c in enumerate(CALLS))


class NcclCollector(LibraryCollector):
    name = "nccl"
    source = "nccl.bpf.c"
    ringbufs = ("nccl_events",)
    calls = NCCL_LIBRARIES

    def defines(self) -> dict[str, int | str]:
        return {"NCCL_CALLS": call_list()}

    def attach_call(self, bpf, opened: str, sym: str, base: str) -> None:
        bpf.attach_uprobe(name=opened, sym=sym, fn_name=f"enter_{base}")
        bpf.attach_uretprobe(name=opened, sym=sym, fn_name=f"return_{base}")

    def forget(self, bpf, tids: list[int]) -> None:
        """An exited thread's entry (its call count and the call it was in)."""
        delete_keys(bpf["nccl_threads"], tids)

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        return [
            make_batch(
                "collective",
                {
                    "ts_ns": r["ts_ns"].astype(np.int64),
                    "dur_ns": r["dur_ns"].astype(np.int64),
                    "tid": r["tid"].astype(np.int32),
                    "pid": r["pid"].astype(np.int32),
                    "name": [CALLS[c].name for c in r["name"].tolist()],
                    "seq": r["seq"].astype(np.int32),
                    "comm": r["comm"],
                    "elements": r["elements"].astype(np.int64),
                    "ret": r["ret"].astype(np.int64),
                },
            )
        ]
