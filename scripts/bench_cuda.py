#!/usr/bin/env python3
"""What the cuda probe costs, on the stand-in CUDA runtime and driver (scripts/fake-cuda):

1. launches: the in-kernel cost per launch (kernel.bpf_stats_enabled: run_time_ns of the
   uprobe programs over the launches made), for a driver launch (one entry probe) and a
   runtime launch (its entry probe plus the driver launch it makes), and the launch rate
   with and without the probe, side by side in one run (the median of --rounds
   measurements, and their range); the counts must be exact;
2. waits: stream synchronisations (each on a kernel of --wait-us) as fast as the stand-in
   runs them, the ring buffer drained as the recorder does; every wait must arrive, none
   lost (the target: none lost at >= 10k waits/s).

    sudo .venv/bin/python scripts/bench_cuda.py [--launches N] [--rounds N] [--waits N]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainbpf.tracer import loader
from trainbpf.tracer.collector import ThreadTable
from trainbpf.tracer.collectors.cuda import CudaCollector
from trainbpf.tracer.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import benchlib as bl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def build_standin(out: Path) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    spec = importlib.util.spec_from_file_location("fake_cuda_build", ROOT / "scripts" / "fake-cuda" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runtime = module.build(out)
    return ctypes.CDLL(str(runtime)), ctypes.CDLL(str(runtime.parent / "../../cuda_driver/lib/libcuda.so.1"))


def bpf_run_ns() -> int:
    """run_time_ns summed over this process's BPF programs."""
    return sum(ns for _, ns in bl.program_stats(os.getpid()).values())


def launch_rate(call, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return n / (time.perf_counter() - t0)


def measure_launches(kinds: dict, untraced: dict[str, float], launches: int, rounds: int) -> dict[str, float]:
    """Each kind's in-kernel ns per launch (median of `rounds`), one printed row a kind."""
    print(f"{'kind':36} {'untraced /s':>12} {'traced /s':>10} {'ratio':>6} {'in-kernel ns/launch':>20} "
          f"{'range':>10}")
    per_launch = {}
    for name, call in kinds.items():
        costs, rates = [], []
        for _ in range(rounds):
            ns0 = bpf_run_ns()
            rates.append(launch_rate(call, launches))
            costs.append((bpf_run_ns() - ns0) / launches)
        per_launch[name] = statistics.median(costs)
        rate = statistics.median(rates)
        print(f"{name:36} {untraced[name]:12.0f} {rate:10.0f} {rate / untraced[name]:6.2f} "
              f"{per_launch[name]:20.0f} {min(costs):5.0f}-{max(costs):.0f}")
    return per_launch


def stream_waits(bpf, rt: ctypes.CDLL, threads: int, per_thread: int) -> tuple[float, int]:
    """`threads` threads each launching and synchronising `per_thread` times while the ring
    buffer is drained as the recorder does: (seconds taken, events that arrived)."""
    seen = 0
    one, null = Dim3(1, 1, 1), ctypes.c_size_t(0)

    def arrived(_ctx, _data, _size) -> None:
        nonlocal seen
        seen += 1

    bpf["cuda_events"].open_ring_buffer(arrived)
    stop, go = threading.Event(), threading.Event()

    def drain() -> None:
        while not stop.is_set():
            bpf.ring_buffer_poll(100)

    def synchronise(n: int) -> None:
        loader.set_traced(bpf, threading.get_native_id(), os.getpid())
        stream = ctypes.c_void_p(0x5151 + threading.get_native_id())
        go.wait()
        for _ in range(n):
            rt.cudaLaunchKernel(None, one, one, None, null, stream)
            rt.cudaStreamSynchronize(stream)

    poller = threading.Thread(target=drain)
    poller.start()
    workers = [threading.Thread(target=synchronise, args=(per_thread,)) for _ in range(threads)]
    for w in workers:
        w.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    go.set()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    time.sleep(0.3)
    stop.set()
    poller.join()
    bpf.ring_buffer_consume()
    return wall, seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=200_000, help="launches per kind (default 200000)")
    parser.add_argument("--rounds", type=int, default=3, help="launch measurements per kind (default 3)")
    parser.add_argument("--waits", type=int, default=50_000, help="synchronisations to stream (default 50000)")
    parser.add_argument("--threads", type=int, default=2, help="threads issuing synchronisations (default 2)")
    parser.add_argument("--wait-us", type=float, default=0.0, help="GPU time of each waited-for kernel (default 0: the rate is then the probes' own limit)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_cuda: run as root (it loads BPF programs)")
    work = Path(tempfile.mkdtemp(prefix="trainbpf-bench-cuda-"))
    rt, drv = build_standin(work)
    one, null = Dim3(1, 1, 1), ctypes.c_size_t(0)
    kinds = {
        "driver launch (cuLaunchKernel)": lambda: drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None),
        "runtime launch (cudaLaunchKernel)": lambda: rt.cudaLaunchKernel(None, one, one, None, null, None),
    }
    drv.fakecuda_set_kernel_ns(ctypes.c_uint64(0))
    untraced = {name: launch_rate(call, args.launches) for name, call in kinds.items()}

    settings = Settings(min_cuda_ns=0)  # every synchronisation streams, however short
    collector = CudaCollector(settings)
    with bl.bpf_stats():
        bpf = loader.load([collector], settings)
        try:
            loader.set_traced(bpf, threading.get_native_id(), os.getpid())
            threads = ThreadTable()  # the recorder's table, which the collector's scan reads the pids from
            threads.tgid[threading.get_native_id()] = os.getpid()
            collector.seeded(bpf, [], threads, 0)
            print(f"machine: {os.uname().release}, {os.cpu_count()} CPUs; {args.launches} launches per kind, "
                  f"{args.rounds} rounds")
            per_launch = measure_launches(kinds, untraced, args.launches, args.rounds)
            issued = 2 * args.launches * args.rounds
            batches = collector.drain(bpf, 0, final=True)
            counted, nested = (sum(int(b.column("count").to_numpy()[b.column("op").to_numpy() == op].sum())
                                   for b in batches) for op in (0, 1))
            exact = counted == issued and nested == issued // 2  # one nested driver launch per runtime launch
            print(f"launches issued {issued}, counted {counted} (+{nested} nested): "
                  f"{'exact' if exact else 'NOT exact'}")
            drv.fakecuda_set_kernel_ns(ctypes.c_uint64(int(args.wait_us * 1000)))
            per_thread = args.waits // args.threads
            waits = per_thread * args.threads
            wall, seen = stream_waits(bpf, rt, args.threads, per_thread)
            lost = loader.lost_counts(bpf).get("cuda", 0)
        finally:
            loader.detach(bpf)
    # each synchronisation is streamed twice: the runtime call and the driver call inside it
    print(f"waits: {waits} at {waits / wall:.0f}/s; events streamed {seen} of {2 * waits}, lost {lost}")
    worst = max(per_launch.values())
    print(f"summary: in-kernel cost per launch {' / '.join(f'{v:.0f}' for v in per_launch.values())} ns "
          f"(driver / runtime, medians; target <= 300: {'met' if worst <= 300 else 'not met'}); "
          f"waits at {waits / wall:.0f}/s ({'>=' if waits / wall >= 10_000 else 'below'} 10k/s): "
          f"{'none lost' if seen == 2 * waits and lost == 0 else 'EVENTS MISSING'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
