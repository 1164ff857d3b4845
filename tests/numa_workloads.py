"""Host->device copies through the stand-in CUDA runtime (scripts/fake-cuda) from host
memory on this machine's one NUMA node (node 0), for the copy-source tests.

    python numa_workloads.py --runtime LIBCUDART --hold-until FILE --seconds S --out OUT.json

Prints "ready pid=N", waits until FILE exists (the recorder's spool), loads the runtime
and waits for its uprobes.  Then for S seconds a thread named tb_loader copies a
COPY_BYTES host buffer (touched: its pages are on node 0) to a device pointer with
cudaMemcpy, and every fourth copy also copies from the device pointer (a source that is
not host memory).  Writes the loader's tid, the host buffer's address and the copies
made to OUT.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time

from cuda_workloads import wait_for_file
from kernel_workloads import set_thread_name, wait_for_uprobes

COPY_BYTES = 1 << 20  # 100 us at the stand-in's 10 GB/s: over the probe's 20 us threshold
COPY_GAP_S = 0.002
HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2


def copies(runtime: str, seconds: float) -> dict:
    rt = ctypes.CDLL(runtime)
    wait_for_uprobes(rt, ["cudaMemcpy", "cudaMalloc"], timeout=60)
    host = mmap.mmap(-1, COPY_BYTES)
    host.write(b"\x01" * COPY_BYTES)  # every page faulted in, on node 0
    host_ptr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    device = ctypes.c_void_p()
    rt.cudaMalloc(ctypes.byref(device), ctypes.c_size_t(COPY_BYTES))
    out: dict = {"host_ptr": host_ptr, "device_ptr": device.value, "to_device": 0, "from_device": 0}

    def loader() -> None:
        set_thread_name("tb_loader")
        out["loader"] = threading.get_native_id()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rt.cudaMemcpy(device, ctypes.c_void_p(host_ptr), ctypes.c_size_t(COPY_BYTES), HOST_TO_DEVICE)
            out["to_device"] += 1
            if out["to_device"] % 4 == 0:
                rt.cudaMemcpy(ctypes.c_void_p(host_ptr), device, ctypes.c_size_t(COPY_BYTES), DEVICE_TO_HOST)
                out["from_device"] += 1
            time.sleep(COPY_GAP_S)

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", required=True)
    parser.add_argument("--hold-until", required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(f"ready pid={os.getpid()}", flush=True)
    wait_for_file(args.hold_until)
    with open(args.out, "w") as f:
        json.dump(copies(args.runtime, args.seconds), f)


if __name__ == "__main__":
    main()
