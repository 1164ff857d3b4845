"""Memory workloads for the huge-page and TLB tests, speaking kernel_workloads.py's
protocol: "ready", wait for a line on stdin, run, print a JSON line, exit.  Run as
`python memory_workloads.py NAME [ARGS]`."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time

CHURN_BYTES = 64 << 20
PAGE = 4096


def churn(advice: int, rounds: int) -> None:
    """Map CHURN_BYTES, advise them, touch every 4 KiB page, unmap; `rounds` times."""
    for _ in range(rounds):
        m = mmap.mmap(-1, CHURN_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(advice)
        for off in range(0, CHURN_BYTES, PAGE):
            m[off] = 1
        m.close()


def thp_pair(rounds: int) -> dict:
    """The same churn twice at once: this process with MADV_HUGEPAGE, a child process
    (started before the recording, so neither copies the other's pages) with
    MADV_NOHUGEPAGE; each warmed by one round before it starts."""
    child = subprocess.Popen([sys.executable, __file__, "_small_pages", str(rounds)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    churn(mmap.MADV_HUGEPAGE, 1)
    _ready_then_go()
    child.stdin.write("go\n")
    child.stdin.flush()
    churn(mmap.MADV_HUGEPAGE, rounds)
    child.stdout.readline()
    child.wait()
    return {"huge": os.getpid(), "small": child.pid, "mapped_bytes": rounds * CHURN_BYTES}


def _small_pages(rounds: int) -> dict:
    churn(mmap.MADV_NOHUGEPAGE, 1)
    _ready_then_go()
    churn(mmap.MADV_NOHUGEPAGE, rounds)
    return {}


def tlb_pair(seconds: float) -> dict:
    """A thread ("tb_unmapper", on CPU 0) mapping, touching and unmapping 1 MiB in a loop
    while this thread, the trainer, spins on CPU 1: each munmap makes the kernel flush
    the trainer's CPU's TLB with an IPI."""
    os.sched_setaffinity(0, {1})
    _ready_then_go()
    out = {"trainer": threading.get_native_id()}
    done = threading.Event()

    def unmap_loop() -> None:
        os.sched_setaffinity(0, {0})
        _name_thread("tb_unmapper")
        out["unmapper"] = threading.get_native_id()
        rounds = 0
        while not done.is_set():
            m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for off in range(0, 1 << 20, PAGE):
                m[off] = 1
            m.close()
            rounds += 1
        out["munmaps"] = rounds

    worker = threading.Thread(target=unmap_loop)
    worker.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    done.set()
    worker.join()
    return out


def _name_thread(name: str) -> None:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name)


def _ready_then_go() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()  # go


WORKLOADS = {"thp_pair": thp_pair, "_small_pages": _small_pages, "tlb_pair": tlb_pair}

if __name__ == "__main__":
    name, args = sys.argv[1], [float(a) if "." in a else int(a) for a in sys.argv[2:]]
    result = WORKLOADS[name](*args)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
