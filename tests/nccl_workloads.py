"""A job of several ranks on the stand-in NCCL (scripts/fake-nccl), for the nccl probe's
tests.  Speaks kernel_workloads.py's protocol: prints "ready", starts on a line from
stdin, prints one JSON line at the end.

    python nccl_workloads.py allreduce LIBNCCL RANKS CALLS SLOW_RANK SLOW_MS
    python nccl_workloads.py p2p LIBNCCL RANKS CALLS

The launcher (this process, which never loads NCCL) starts RANKS rank processes and
waits for them.  Each rank loads the library only then, after the recorder started,
waits for the uprobes on it and joins the communicator (ncclCommInitRank: every rank
is probed before any collective).  Then:

- allreduce: CALLS ncclAllReduce of 1000 + i elements; rank SLOW_RANK sleeps SLOW_MS
  before each, so it arrives last every time and the others wait for it;
- p2p: CALLS rounds of ncclGroupStart, ncclSend of 100 + i elements to the next rank,
  ncclRecv of 200 + i from the previous one, ncclGroupEnd; then one ncclBroadcast,
  ncclReduce, ncclAllGather and ncclReduceScatter (300-303 elements), and an
  ncclBroadcast without a communicator (ncclInvalidArgument).

Each rank reports its pid, main thread, communicator and the calls it made in order, as
(name, elements, comm, ret) with comm 0 for ncclGroupEnd: the rows the probe must give.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from kernel_workloads import wait_for_uprobes

PROBED = ["ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
          "ncclSend", "ncclRecv", "ncclGroupEnd"]
FLOAT32, SUM = 7, 0  # ncclFloat32, ncclSum
RANK_TIMEOUT_S = 120


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def join(lib: ctypes.CDLL, rendezvous: str, nranks: int, rank: int) -> int:
    """This rank's communicator, made once every rank has joined."""
    uid = UniqueId(rendezvous.encode())
    comm = ctypes.c_void_p()
    ret = lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank)
    if ret != 0:
        raise SystemExit(f"rank {rank}: ncclCommInitRank returned {ret}")
    return comm.value


def allreduce(lib: ctypes.CDLL, comm: int, rank: int, nranks: int, calls: int, slow_rank: int,
              slow_ms: float) -> list[tuple]:
    made = []
    for i in range(calls):
        if rank == slow_rank:
            time.sleep(slow_ms / 1000)
        ret = lib.ncclAllReduce(None, None, ctypes.c_size_t(1000 + i), FLOAT32, SUM, ctypes.c_void_p(comm), None)
        made.append(("ncclAllReduce", 1000 + i, comm, ret))
    return made


def p2p(lib: ctypes.CDLL, comm: int, rank: int, nranks: int, calls: int) -> list[tuple]:
    made = []
    c = ctypes.c_void_p(comm)
    for i in range(calls):
        lib.ncclGroupStart()
        sent = lib.ncclSend(None, ctypes.c_size_t(100 + i), FLOAT32, (rank + 1) % nranks, c, None)
        received = lib.ncclRecv(None, ctypes.c_size_t(200 + i), FLOAT32, (rank - 1) % nranks, c, None)
        ended = lib.ncclGroupEnd()
        made += [("ncclSend", 100 + i, comm, sent), ("ncclRecv", 200 + i, comm, received),
                 ("ncclGroupEnd", 0, 0, ended)]
    n = ctypes.c_size_t
    made += [
        ("ncclBroadcast", 300, comm, lib.ncclBroadcast(None, None, n(300), FLOAT32, 0, c, None)),
        ("ncclReduce", 301, comm, lib.ncclReduce(None, None, n(301), FLOAT32, SUM, 0, c, None)),
        ("ncclAllGather", 302, comm, lib.ncclAllGather(None, None, n(302), FLOAT32, c, None)),
        ("ncclReduceScatter", 303, comm, lib.ncclReduceScatter(None, None, n(303), FLOAT32, SUM, c, None)),
        ("ncclBroadcast", 304, 0, lib.ncclBroadcast(None, None, n(304), FLOAT32, 0, None, None)),
    ]
    return made


def rank_main(rank: int, mode: str, library: str, nranks: int, calls: int, rendezvous: str, *more: str) -> dict:
    lib = ctypes.CDLL(library)
    wait_for_uprobes(lib, PROBED, timeout=60)
    # Each call's return probe attaches just after its entry probe wrote the breakpoint.
    time.sleep(0.1)
    comm = join(lib, rendezvous, nranks, rank)
    if mode == "allreduce":
        made = allreduce(lib, comm, rank, nranks, calls, int(more[0]), float(more[1]))
    else:
        made = p2p(lib, comm, rank, nranks, calls)
    lib.ncclCommDestroy(ctypes.c_void_p(comm))
    return {"rank": rank, "pid": os.getpid(), "tid": threading.get_native_id(), "comm": comm, "calls": made}


def launch(mode: str, library: str, nranks: str, *args: str) -> dict:
    """Start the ranks and gather what each reports."""
    where = tempfile.mkdtemp(prefix="fakenccl-")
    try:
        rendezvous = os.path.join(where, "id")
        # Each rank's variables, as launchers set them (torchrun, mpirun, srun).
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), mode, library, nranks, args[0],
                                   rendezvous, *args[1:]], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": nranks})
                 for r in range(int(nranks))]
        return {"ranks": [json.loads(p.communicate(timeout=RANK_TIMEOUT_S)[0]) for p in procs]}
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank, mode, library, nranks, calls, rendezvous, *more = sys.argv[2:]
        print(json.dumps(rank_main(int(rank), mode, library, int(nranks), int(calls), rendezvous, *more)))
    else:
        print("ready", flush=True)
        sys.stdin.readline()  # go
        print(json.dumps(launch(*sys.argv[1:])), flush=True)
