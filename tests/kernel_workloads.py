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
    for the GIL; timer wake-ups of a sleeper sharing its CPU with a spinner."""
    out: dict = {"main": threading.get_native_id()}
    _gil_turns(out)
    time.sleep(1.2)  # a recorder flush while the process is alive describes the addresses
    _run_thread(_futex_wait, out)
    _handoff(out)
    _run_thread(_touch_pages, out)
    for _ in range(4):
        m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m[0] = 1
        m.close()
    out["child"] = _forked_child()
    _timer_wakeups(out)
    return out


def _run_thread(target, out: dict) -> None:
    """`target(out)` in a thread of its own, waited for."""
    t = threading.Thread(target=target, args=(out,))
    t.start()
    t.join()


def _gil_turns(out: dict) -> None:
    """Two threads spinning in pure Python: they take turns holding the GIL."""
    def gil_spinner(i: int) -> None:
        set_thread_name(f"tb_gil{i}")
        out[f"gil{i}"] = threading.get_native_id()
        spin(0.3)

    spinners = [threading.Thread(target=gil_spinner, args=(i,)) for i in range(2)]
    for t in spinners:
        t.start()
    for t in spinners:
        t.join()


def _futex_wait(out: dict) -> None:
    set_thread_name("tb_waiter")
    out["waiter"] = threading.get_native_id()
    threading.Event().wait(0.05)  # one futex wait with a 50 ms timeout


def _handoff(out: dict) -> None:
    """The main thread (the consumer) blocks on a queue; a producer thread wakes it."""
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
        handoff.get()
    p.join()


def _touch_pages(out: dict) -> None:
    set_thread_name("tb_toucher")
    out["toucher"] = threading.get_native_id()
    size = 200 << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per 4 KiB page
    for off in range(0, size, 4096):
        m[off] = 1
    m.close()


def _forked_child() -> int:
    """A child process, named after the fork, that runs, sleeps and exits; its pid."""
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
    return child


def _timer_wakeups(out: dict) -> None:
    """Timers wake a sleeper while a traced spinner holds its CPU: the wake-ups run in
    interrupt context, where `current` (the spinner, mostly) is no waker."""
    cpu = min(os.sched_getaffinity(0))
    spinner = os.fork()
    if spinner == 0:
        os.sched_setaffinity(0, {cpu})
        set_thread_name("tb_spinner")
        spin(0.5)
        os._exit(0)

    def sleeper() -> None:
        set_thread_name("tb_sleeper")
        out["sleeper"] = threading.get_native_id()
        os.sched_setaffinity(0, {cpu})
        for _ in range(10):
            time.sleep(0.02)

    t = threading.Thread(target=sleeper)
    t.start()
    t.join()
    os.waitpid(spinner, 0)
    out["spinner"] = spinner


def bursts(cpu: int, seconds: str) -> dict:
    """A trainer's rhythm on one CPU: 5 ms of work, a 1 ms sleep, for `seconds`; whatever
    else runs on that CPU preempts it."""
    os.sched_setaffinity(0, {cpu})
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        spin(0.005)
        time.sleep(0.001)
    return {"main": threading.get_native_id()}


def dirty(path: str, total_mb: int) -> dict:
    """Buffered writes of `total_mb` MB (no fsync): the writer meets dirty throttling."""
    set_thread_name("tb_writer")
    buf = b"\xab" * (4 << 20)
    with open(path, "wb") as fh:
        for _ in range(total_mb // 4):
            fh.write(buf)
    os.unlink(path)
    return {"writer": threading.get_native_id()}


WRITE_CHUNK = 1 << 20  # bytes per write of write_paths
WRITES = 4


def write_paths(folder: str) -> dict:
    """WRITES writes of WRITE_CHUNK bytes to each of four files, each by a thread of its
    own: buffered (write), O_DIRECT (write and pwritev2 from a page-aligned buffer),
    io_uring (buffered: its folios are dirtied inside io_uring_enter or by the ring's
    workers), and stores into a shared mapping flushed by msync."""
    from io_uring_raw import io_uring_write

    def buffered(out: dict) -> None:
        set_thread_name("tb_buffered")
        out["buffered"] = threading.get_native_id()
        with open(os.path.join(folder, "buffered.bin"), "wb", buffering=0) as fh:
            for _ in range(WRITES):
                fh.write(b"\xab" * WRITE_CHUNK)

    def direct(out: dict) -> None:
        set_thread_name("tb_direct")
        out["direct"] = threading.get_native_id()
        buf = mmap.mmap(-1, WRITE_CHUNK)  # page-aligned, as O_DIRECT wants
        buf.write(b"\xcd" * WRITE_CHUNK)
        fd = os.open(os.path.join(folder, "direct.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        for i in range(WRITES):  # write() and Python's pwritev (the pwritev2 syscall) in turn
            written = os.pwritev(fd, [buf], i * WRITE_CHUNK) if i % 2 else os.write(fd, buf)
            assert written == WRITE_CHUNK
            os.lseek(fd, (i + 1) * WRITE_CHUNK, os.SEEK_SET)
        os.close(fd)

    def uring(out: dict) -> None:
        set_thread_name("tb_io_uring")
        out["io_uring"] = threading.get_native_id()
        fd = os.open(os.path.join(folder, "io_uring.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for i in range(WRITES):
            assert io_uring_write(fd, b"\xef" * WRITE_CHUNK, i * WRITE_CHUNK) == WRITE_CHUNK
        os.close(fd)

    def mapped(out: dict) -> None:
        set_thread_name("tb_mapped")
        out["mapped"] = threading.get_native_id()
        fd = os.open(os.path.join(folder, "mapped.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.ftruncate(fd, WRITES * WRITE_CHUNK)
        with mmap.mmap(fd, WRITES * WRITE_CHUNK, mmap.MAP_SHARED) as m:
            for i in range(WRITES):
                m[i * WRITE_CHUNK:(i + 1) * WRITE_CHUNK] = b"\x5a" * WRITE_CHUNK
                m.flush()  # msync: the next store into a written page faults (and dirties it) again
        os.close(fd)

    out: dict = {}
    for target in (buffered, direct, uring, mapped):
        _run_thread(target, out)
    return out


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


def page_cache(read_path: str, write_path: str, write_mb: int) -> dict:
    """Two children: a reader reads `read_path` (buffered) twice, its pages dropped
    (fadvise DONTNEED) in between so the second read brings them back; a writer writes
    `write_mb` MB to `write_path` and syncs it."""
    def reader() -> None:
        set_thread_name("tb_reader")
        fd = os.open(read_path, os.O_RDONLY)
        while os.read(fd, 1 << 20):
            pass
        time.sleep(0.6)  # a cgroup sample sees the file cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        while os.read(fd, 1 << 20):
            pass

    def writer() -> None:
        set_thread_name("tb_writer")
        with open(write_path, "wb") as fh:
            for _ in range(write_mb):
                fh.write(os.urandom(1 << 20))
            fh.flush()
            os.fsync(fh.fileno())

    children = {}
    for name, work in (("reader", reader), ("writer", writer)):
        child = os.fork()
        if child == 0:
            work()
            os._exit(0)
        children[name] = child
    for child in children.values():
        os.waitpid(child, 0)
    return children


def sleeper(seconds: str) -> dict:
    """Exits after `seconds` (the target-exit test)."""
    time.sleep(float(seconds))
    return {"main": threading.get_native_id()}


def forked_worker(seconds: str) -> dict:
    """A forked worker that sleeps in short naps for `seconds` and exits; the parent
    outlives it by a second and a half (its stacks must be named after the stop)."""
    child = os.fork()
    if child == 0:
        set_thread_name("tb_worker")
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            time.sleep(0.1)
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(1.5)
    return {"main": threading.get_native_id(), "worker": child}


def short_threads(count: int) -> dict:
    """`count` threads, each waiting 30 ms on an event (a futex wait) and exiting, one
    after another; then the main thread outlives them by two and a half seconds (two
    flushes, which forget the exited threads)."""
    tids = []

    def wait() -> None:
        tids.append(threading.get_native_id())
        threading.Event().wait(0.03)

    for _ in range(count):
        t = threading.Thread(target=wait)
        t.start()
        t.join()
    time.sleep(2.5)
    return {"main": threading.get_native_id(), "workers": tids}


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def wait_for_uprobes(lib: ctypes.CDLL, names: list[str], timeout: float = 10.0) -> None:
    """Until a uprobe sits on each function: the kernel writes a breakpoint (int3, 0xcc)
    over its first instruction.  The recorder probes a library loaded after the start at
    its next flush."""
    addrs = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
    end = time.monotonic() + timeout
    while not all(ctypes.string_at(a, 1) == b"\xcc" for a in addrs):
        if time.monotonic() > end:
            raise SystemExit(f"no uprobes on {names} after {timeout} s")
        time.sleep(0.05)


CUDA_LAUNCHES = {"runtime": 300, "runtime_ptsz": 200, "driver_thread": 250, "child": 150}
CUDA_WAIT_MS = (2, 5, 8, 12, 20)
CUDA_FREE_MS = 15  # the copy a cudaFree waits for


def cuda_fake(runtime: str) -> dict:
    """Loads the stand-in CUDA runtime (scripts/fake-cuda) only now, after the recorder
    started; launches CUDA_LAUNCHES kernels from the main thread (plain and _ptsz), a
    thread (straight through the driver) and a forked child; then synchronises on
    kernels of CUDA_WAIT_MS each, copies and allocates.  Reports each wait's span."""
    rt = ctypes.CDLL(runtime)
    drv = ctypes.CDLL(os.path.join(os.path.dirname(runtime), "../../cuda_driver/lib/libcuda.so.1"))
    wait_for_uprobes(rt, ["cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaStreamSynchronize_ptsz",
                          "cudaDeviceSynchronize", "cudaMemcpyAsync_ptsz", "cudaMalloc"])
    wait_for_uprobes(drv, ["cuLaunchKernel", "cuStreamSynchronize_ptsz", "cuMemAlloc_v2"])
    one = Dim3(1, 1, 1)
    out: dict = {"main": threading.get_native_id(), "waits": []}
    drv.fakecuda_set_kernel_ns(ctypes.c_uint64(10_000))
    for _ in range(CUDA_LAUNCHES["runtime"]):
        rt.cudaLaunchKernel(None, one, one, None, ctypes.c_size_t(0), None)
    for _ in range(CUDA_LAUNCHES["runtime_ptsz"]):
        rt.cudaLaunchKernel_ptsz(None, one, one, None, ctypes.c_size_t(0), None)

    def driver_thread() -> None:
        out["driver_thread"] = threading.get_native_id()
        for _ in range(CUDA_LAUNCHES["driver_thread"]):
            drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)

    t = threading.Thread(target=driver_thread)
    t.start()
    t.join()
    child = os.fork()
    if child == 0:
        for _ in range(CUDA_LAUNCHES["child"]):
            rt.cudaLaunchKernel(None, one, one, None, ctypes.c_size_t(0), None)
        os._exit(0)
    os.waitpid(child, 0)
    out["child"] = child
    rt.cudaDeviceSynchronize()
    stream = ctypes.c_void_p(0x5757)
    for i, ms in enumerate(CUDA_WAIT_MS):
        drv.fakecuda_set_kernel_ns(ctypes.c_uint64(ms * 1_000_000))
        rt.cudaLaunchKernel_ptsz(None, one, one, None, ctypes.c_size_t(0), stream)
        sync = rt.cudaStreamSynchronize_ptsz if i % 2 == 0 else rt.cudaDeviceSynchronize
        t0 = time.monotonic_ns()
        sync(stream) if i % 2 == 0 else sync()
        out["waits"].append([t0, time.monotonic_ns()])
    ptr = ctypes.c_void_p()
    out["malloc"] = rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
    rt.cudaMemcpy(ptr, None, ctypes.c_size_t(20_000_000), 1)  # 2 ms at the stand-in's 10 GB/s
    rt.cudaMemcpyAsync_ptsz(ptr, None, ctypes.c_size_t(1 << 20), 1, stream)
    drv.cuMemcpyAsync(ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_size_t(CUDA_FREE_MS * 10_000_000), stream)
    t0 = time.monotonic_ns()
    rt.cudaFree(ptr)  # waits for the copy queued before it
    out["free"] = [t0, time.monotonic_ns()]
    wait_for_uprobes(rt, ["cudaHostAlloc", "cudaFreeHost"])
    host = ctypes.c_void_p()
    rt.cudaHostAlloc(ctypes.byref(host), ctypes.c_size_t(1 << 20), 0)
    out["host_ptr"] = host.value
    rt.cudaFreeHost(host)
    return out


def cuda_real(runtime: str) -> dict:
    """Loads a real libcudart after the recorder started and makes calls that fail
    without a driver; reports their return values."""
    rt = ctypes.CDLL(runtime)
    wait_for_uprobes(rt, ["cudaMalloc", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaFree"])
    ptr = ctypes.c_void_p()
    count = ctypes.c_int()
    return {
        "main": threading.get_native_id(),
        "cudaGetDeviceCount": rt.cudaGetDeviceCount(ctypes.byref(count)),
        "cudaMalloc": rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)),
        "cudaDeviceSynchronize": rt.cudaDeviceSynchronize(),
        "cudaStreamSynchronize": rt.cudaStreamSynchronize(ctypes.c_void_p(0x5757)),
        "cudaFree": rt.cudaFree(None),
    }


def fill_batch(size: int) -> mmap.mmap:
    """A fresh anonymous batch buffer, every 4 KiB page faulted in."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    for off in range(0, size, 4096):
        m[off] = 1
    return m


def held_batches(depth: int, seconds: str) -> dict:
    """A step loop that maps a fresh 8 MiB batch each step and keeps the last `depth`
    (0: unmaps each at once): the oldest is unmapped just before the next is mapped."""
    set_thread_name("tb_holder")
    held: list[mmap.mmap] = []
    end = time.perf_counter() + float(seconds)
    while time.perf_counter() < end:
        if len(held) >= max(depth, 1):
            held.pop(0).close()
        held.append(fill_batch(8 << 20))
        spin(0.005)  # the step's own work
    return {"holder": threading.get_native_id()}


WORKLOADS = {"basic": basic, "held_batches": held_batches, "dirty": dirty, "reclaim": reclaim, "sleeper": sleeper, "cuda_fake": cuda_fake,
             "cuda_real": cuda_real, "forked_worker": forked_worker, "short_threads": short_threads,
             "bursts": bursts, "write_paths": write_paths, "page_cache": page_cache}

if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()  # go
    result = WORKLOADS[name](*[int(a) if a.isdigit() else a for a in args])
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
