"""Small workloads for the probe tests.  Each waits for a line on stdin (sent once the
recorder is attached), does one thing the probes must see, prints a JSON line naming the
thread ids involved, and exits.  Run as `python kernel_workloads.py NAME [ARGS]`."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import queue
import sys
import threading
import time

libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NAME = 15


def set_thread_name(name: str) -> None:
    libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def basic() -> dict:
    """A 50 ms futex wait; a producer waking a consumer; 200 MB of faults; 64 MB
    mmap/munmap; a child process forked after start and named; two threads contending
    for the GIL."""
    out: dict = {"main": threading.get_native_id()}

    def gil_spinner(i: int) -> None:
        set_thread_name(f"tb_gil{i}")
        out[f"gil{i}"] = threading.get_native_id()
        spin(0.3)  # pure Python: the two take turns holding the GIL

    spinners = [threading.Thread(target=gil_spinner, args=(i,)) for i in range(2)]
    for t in spinners:
        t.start()
    for t in spinners:
        t.join()
    time.sleep(1.2)  # a recorder flush while the process is alive describes the addresses

    def waiter() -> None:
        set_thread_name("tb_waiter")
        out["waiter"] = threading.get_native_id()
        threading.Event().wait(0.05)  # one futex wait with a 50 ms timeout

    t = threading.Thread(target=waiter)
    t.start()
    t.join()

    handoff: queue.Queue = queue.Queue()

    def producer() -> None:
        set_thread_name("tb_producer")
        out["producer"] = threading.get_native_id()
        for _ in range(5):
            spin(0.03)  # producing: on-CPU until the wake-up
            handoff.put(1)

    p = threading.Thread(target=producer)
    p.start()
    for _ in range(5):
        handoff.get()  # the consumer (main thread) blocks; the producer wakes it
    p.join()

    def toucher() -> None:
        set_thread_name("tb_toucher")
        out["toucher"] = threading.get_native_id()
        size = 200 << 20
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per 4 KiB page
        for off in range(0, size, 4096):
            m[off] = 1
        m.close()

    t = threading.Thread(target=toucher)
    t.start()
    t.join()

    for _ in range(4):
        m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m[0] = 1
        m.close()

    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        set_thread_name("tb_child")
        os.close(r)
        spin(0.05)
        time.sleep(0.05)
        os.write(w, b"x")
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.waitpid(child, 0)
    out["child"] = child
    return out


def dirty(path: str, total_mb: int) -> dict:
    """Buffered writes of `total_mb` MB (no fsync): the writer meets dirty throttling."""
    set_thread_name("tb_writer")
    buf = b"\xab" * (4 << 20)
    with open(path, "wb") as fh:
        for _ in range(total_mb // 4):
            fh.write(buf)
    os.unlink(path)
    return {"writer": threading.get_native_id()}


def reclaim(path: str, total_mb: int) -> dict:
    """Write then read back a file larger than the cgroup's limit: page cache must be
    reclaimed inside the cgroup, by this thread."""
    set_thread_name("tb_reclaim")
    buf = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(total_mb):
            fh.write(buf)
    with open(path, "rb") as fh:
        while fh.read(4 << 20):
            pass
    os.unlink(path)
    return {"reclaimer": threading.get_native_id()}


def sleeper(seconds: str) -> dict:
    """Exits after `seconds` (the target-exit test)."""
    time.sleep(float(seconds))
    return {"main": threading.get_native_id()}


WORKLOADS = {"basic": basic, "dirty": dirty, "reclaim": reclaim, "sleeper": sleeper}

if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()  # go
    result = WORKLOADS[name](*[int(a) if a.isdigit() else a for a in args])
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
