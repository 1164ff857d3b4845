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
from trainbpf.tracer.collectors.cuda import CudaCollector
from trainbpf.tracer.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def build_standin(out: Path) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    spec = importlib.util.spec_from_file_location("fake_cuda_build", ROOT / "scripts" / "fake-cuda" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runtime = module.build(out)
    return ctypes.CDLL(str(runtime)), ctypes.CDLL(str(runtime.parent / "../../cuda_driver/lib/libcuda.so.1"))


def program_stats() -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over this process's BPF programs."""
    ns = runs = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            text = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue
        if "prog_type" not in text:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        ns += int(fields.get("run_time_ns", 0))
        runs += int(fields.get("run_cnt", 0))
    return ns, runs


def launch_rate(call, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return n / (time.perf_counter() - t0)


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
    stats_before = BPF_STATS.read_text().strip()
    BPF_STATS.write_text("1")
    bpf = loader.load([collector], settings)
    try:
        loader.set_traced(bpf, threading.get_native_id(), os.getpid())
        collector.scan(bpf)
        print(f"machine: {os.uname().release}, {os.cpu_count()} CPUs; {args.launches} launches per kind, "
              f"{args.rounds} rounds")
        print(f"{'kind':36} {'untraced /s':>12} {'traced /s':>10} {'ratio':>6} {'in-kernel ns/launch':>20} "
              f"{'range':>10}")
        per_launch = {}
        for name, call in kinds.items():
            costs, rates = [], []
            for _ in range(args.rounds):
                ns0, _ = program_stats()
                rates.append(launch_rate(call, args.launches))
                ns1, _ = program_stats()
                costs.append((ns1 - ns0) / args.launches)
            per_launch[name] = statistics.median(costs)
            rate = statistics.median(rates)
            print(f"{name:36} {untraced[name]:12.0f} {rate:10.0f} {rate / untraced[name]:6.2f} "
                  f"{per_launch[name]:20.0f} {min(costs):5.0f}-{max(costs):.0f}")
        issued = 2 * args.launches * args.rounds
        batches = collector.drain(bpf, 0, final=True)
        counted, nested = (sum(int(b.column("count").to_numpy()[b.column("op").to_numpy() == op].sum())
                               for b in batches) for op in (0, 1))
        exact = counted == issued and nested == issued // 2  # one nested driver launch per runtime launch
        print(f"launches issued {issued}, counted {counted} (+{nested} nested): {'exact' if exact else 'NOT exact'}")

        seen = 0

        def arrived(_ctx, _data, _size) -> None:
            nonlocal seen
            seen += 1

        bpf["cuda_events"].open_ring_buffer(arrived)
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set():
                bpf.ring_buffer_poll(100)

        poller = threading.Thread(target=drain)
        poller.start()
        drv.fakecuda_set_kernel_ns(ctypes.c_uint64(int(args.wait_us * 1000)))
        per_thread = args.waits // args.threads
        args.waits = per_thread * args.threads

        def synchronise(n: int) -> None:
            loader.set_traced(bpf, threading.get_native_id(), os.getpid())
            stream = ctypes.c_void_p(0x5151 + threading.get_native_id())
            go.wait()
            for _ in range(n):
                rt.cudaLaunchKernel(None, one, one, None, null, stream)
                rt.cudaStreamSynchronize(stream)

        go = threading.Event()
        workers = [threading.Thread(target=synchronise, args=(per_thread,)) for _ in range(args.threads)]
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
        lost = loader.lost_counts(bpf).get("cuda", 0)
        # each synchronisation is streamed twice: the runtime call and the driver call inside it
        print(f"waits: {args.waits} at {args.waits / wall:.0f}/s; events streamed {seen} of {2 * args.waits}, lost {lost}")
        worst = max(per_launch.values())
        print(f"summary: in-kernel cost per launch {' / '.join(f'{v:.0f}' for v in per_launch.values())} ns "
              f"(driver / runtime, medians; target <= 300: {'met' if worst <= 300 else 'not met'}); "
              f"waits at {args.waits / wall:.0f}/s "
              f"({'>=' if args.waits / wall >= 10_000 else 'below'} 10k/s): "
              f"{'none lost' if seen == 2 * args.waits and lost == 0 else 'EVENTS MISSING'}")
    finally:
        loader.detach(bpf)
        BPF_STATS.write_text(stats_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
