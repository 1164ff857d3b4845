"""Pinned batches freed when the GPU is done with them, on the stand-in CUDA runtime
(scripts/fake-cuda), for the held-back-free test; speaks recording.py's protocol
("ready", then "go" on stdin, then one JSON line).

    python held_free_workloads.py LIBCUDART SECONDS

Loads the runtime only after "go" and waits for the uprobes on it.  Two threads then run
the same ring for SECONDS: each step (RING_STEP_S) pins a fresh batch (cudaHostAlloc),
copies it (cudaMemcpyAsync) and records an event for it on its stream; DEPTH steps later
it polls that batch's event (cudaEventQuery, after POLL_S of CPU work in Python each
time) until ready and frees the batch (cudaFreeHost).  tb_held's events stay not ready for HELD_QUERIES queries after
each record (the stand-in's fakecuda_hold_event); tb_prompt's are ready at once."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

from kernel_workloads import set_thread_name, wait_for_uprobes

DEPTH = 3
HELD_QUERIES = 4
RING_STEP_S = 0.02
POLL_S = 0.001
BATCH = 4 << 20
NOT_READY = 600
# Each thread's stream and first event handle (the stand-in takes any pointer-sized value).
HANDLES = {"held": (0x5151, 0xE100), "prompt": (0x6161, 0xE200)}


def release_when_ready(rt: ctypes.CDLL, ptr: ctypes.c_void_p, event: ctypes.c_void_p) -> None:
    """Poll the batch's event until ready, with POLL_S of Python work (bookkeeping, say)
    between queries, then free it."""
    while True:
        stop = time.thread_time() + POLL_S
        while time.thread_time() < stop:
            pass
        if rt.cudaEventQuery(event) != NOT_READY:
            break
    rt.cudaFreeHost(ptr)


def ring(rt: ctypes.CDLL, drv: ctypes.CDLL, role: str, seconds: float, out: dict) -> None:
    set_thread_name(f"tb_{role}")
    out[role] = threading.get_native_id()
    stream, first_event = HANDLES[role]
    events = [ctypes.c_void_p(first_event + i) for i in range(DEPTH + 1)]
    if role == "held":
        for e in events:
            drv.fakecuda_hold_event(e, ctypes.c_uint(HELD_QUERIES))
    pending: list[tuple[ctypes.c_void_p, ctypes.c_void_p]] = []
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        ptr = ctypes.c_void_p()
        rt.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(BATCH), 0)
        rt.cudaMemcpyAsync(None, ptr, ctypes.c_size_t(BATCH), 1, ctypes.c_void_p(stream))
        event = events[step % len(events)]
        rt.cudaEventRecord(event, ctypes.c_void_p(stream))
        pending.append((ptr, event))
        if len(pending) > DEPTH:
            old, old_event = pending.pop(0)
            release_when_ready(rt, old, old_event)
            out["frees"][role] += 1
        step += 1
        time.sleep(RING_STEP_S)


def run(runtime: str, seconds: float) -> dict:
    rt = ctypes.CDLL(runtime)
    drv = ctypes.CDLL(os.path.join(os.path.dirname(runtime), "../../cuda_driver/lib/libcuda.so.1"))
    wait_for_uprobes(rt, ["cudaHostAlloc", "cudaFreeHost", "cudaEventRecord", "cudaEventQuery"], timeout=60)
    wait_for_uprobes(drv, ["cuEventRecord", "cuEventQuery", "cuMemHostAlloc"], timeout=60)
    out: dict = {"frees": {"held": 0, "prompt": 0}}
    threads = [threading.Thread(target=ring, args=(rt, drv, role, seconds, out)) for role in HANDLES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["handles"] = HANDLES
    return out


if __name__ == "__main__":
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()  # go
    sys.stdout.write(json.dumps(run(sys.argv[1], float(sys.argv[2]))) + "\n")
    sys.stdout.flush()
