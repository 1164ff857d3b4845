"""A fine-grained trainer on the stand-in CUDA runtime (scripts/fake-cuda), for the CUDA
analysis test: it alternates data waits (the GPU idle) and GPU waits (the GPU busy)
inside steps of 30-60 ms, and writes the simulated truth to a JSON file.

    python cuda_workloads.py --runtime LIBCUDART --truth OUT.json --hold-until FILE

Prints "ready pid=N", waits until FILE exists (the recorder's spool: the probes are
attaching), only then loads the runtime with ctypes (from the wheel-like tree
scripts/fake-cuda/build.py makes) and waits for the uprobes on it.  Then, for --seconds,
each step of the trainer (the main thread, named tb_trainer):

1. waits on a queue for the next batch, which the loader thread (tb_loader) is still
   computing (D ms, 10-25: the GPU is idle);
2. launches 3-8 kernels on a stream (K ms of GPU work in all, 14-30);
3. synchronises the stream (cudaStreamSynchronize: the trainer waits for the GPU).

The loader starts computing batch i + 1 as the trainer takes batch i, for K_i + D_{i+1}
ms (sleeping: the GIL stays free), so the trainer's data wait is about D_{i+1}.  With
--host-ms H the batches are ready at once and the trainer instead spends H ms of CPU
after each synchronisation in `optimizer_step` (host work in the launch gap: the GPU
has nothing queued).  With
$TRAINBPF_SIM_GPU set the stand-in writes each kernel to the simulated GPU that the
nvidia-smi and NVML stand-ins sample.  The truth, all CLOCK_MONOTONIC ns as the caller
saw them: each step's span (from entering the data wait to the synchronisation's
return), each data wait and each synchronisation, their sums, the kernels' GPU time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import random
import sys
import threading
import time

from kernel_workloads import Dim3, set_thread_name, wait_for_uprobes

STREAM = 0x5151
HOLD_TIMEOUT_S = 300


def plan(seed: int, n: int) -> list[tuple[int, int, int]]:
    """(data_wait_ns, gpu_ns, kernels) per step."""
    rng = random.Random(seed)
    return [(rng.randint(10, 25) * 1_000_000, rng.randint(14, 30) * 1_000_000, rng.randint(3, 8)) for _ in range(n)]


def sleep_until_ns(deadline: int) -> None:
    while (left := deadline - time.monotonic_ns()) > 0:
        time.sleep(left / 1e9)


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def optimizer_step(cpu_ns: int) -> None:
    """Host work on the trainer's own thread: `cpu_ns` of CPU time in Python."""
    stop = time.thread_time_ns() + cpu_ns
    x = 0
    while time.thread_time_ns() < stop:
        x += 1


def train(runtime: str, seconds: float, seed: int, host_ns: int = 0) -> dict:
    rt = ctypes.CDLL(runtime)
    drv = ctypes.CDLL(os.path.join(os.path.dirname(runtime), "../../cuda_driver/lib/libcuda.so.1"))
    wait_for_uprobes(rt, ["cudaLaunchKernel", "cudaStreamSynchronize"], timeout=60)
    wait_for_uprobes(drv, ["cuLaunchKernel", "cuStreamSynchronize"], timeout=60)
    steps = plan(seed, int(seconds / 0.02) + 2)  # more than can run in `seconds`
    if host_ns:
        steps = [(0, gpu_ns, kernels) for _, gpu_ns, kernels in steps]
    batches: queue.Queue = queue.Queue(maxsize=1)
    taken = threading.Event()
    stop = threading.Event()
    truth: dict = {"trainer": threading.get_native_id(), "steps": [], "data_waits": [], "syncs": [],
                   "host": [], "gpu_busy_ns": 0}

    def loader() -> None:
        set_thread_name("tb_loader")
        truth["loader"] = threading.get_native_id()
        previous_gpu = 0
        for data_ns, gpu_ns, _ in steps:
            start = time.monotonic_ns()
            sleep_until_ns(start + previous_gpu + data_ns)  # computing the batch
            batches.put(object())
            taken.wait()  # the next batch starts as the trainer takes this one
            taken.clear()
            if stop.is_set():
                return
            previous_gpu = gpu_ns

    one = Dim3(1, 1, 1)
    stream = ctypes.c_void_p(STREAM)
    set_thread_name("tb_trainer")
    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    end = time.monotonic_ns() + int(seconds * 1e9)
    for _data_ns, gpu_ns, kernels in steps:
        t0 = time.monotonic_ns()
        if t0 >= end:
            break
        batches.get()
        t1 = time.monotonic_ns()
        taken.set()
        drv.fakecuda_set_kernel_ns(ctypes.c_uint64(gpu_ns // kernels))
        for _ in range(kernels):
            rt.cudaLaunchKernel(None, one, one, None, ctypes.c_size_t(0), stream)
        t2 = time.monotonic_ns()
        rt.cudaStreamSynchronize(stream)
        t3 = time.monotonic_ns()
        if host_ns:
            optimizer_step(host_ns)
            truth["host"].append([t3, time.monotonic_ns()])
            t3 = truth["host"][-1][1]
        truth["steps"].append([t0, t3])
        truth["data_waits"].append([t0, t1])
        truth["syncs"].append([t2, t3])
        truth["gpu_busy_ns"] += gpu_ns // kernels * kernels
    stop.set()
    taken.set()
    truth["step_count"] = len(truth["steps"])
    truth["data_wait_ns"] = sum(b - a for a, b in truth["data_waits"])
    truth["sync_ns"] = sum(b - a for a, b in truth["syncs"])
    truth["host_ns"] = sum(b - a for a, b in truth["host"])
    return truth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", required=True, help="the stand-in libcudart.so.12")
    parser.add_argument("--truth", required=True, help="JSON file for the simulated truth")
    parser.add_argument("--hold-until", required=True, metavar="FILE", help="start once FILE exists")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to train (5)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--host-ms", type=float, default=0.0, help="host work after each synchronisation (ms of CPU)")
    args = parser.parse_args()
    print(f"ready pid={os.getpid()}", flush=True)
    wait_for_file(args.hold_until)
    truth = train(args.runtime, args.seconds, args.seed, int(args.host_ms * 1e6))
    tmp = args.truth + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(truth, fh)
    os.replace(tmp, args.truth)
    print("done", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
