"""Shared pieces of the scenario workloads: the simulated GPU, the trainer loop, thread
naming and calibrated CPU work.

Every workload is a toy training loop whose main thread is the trainer: it takes a
batch, marks the simulated GPU busy for one step (appending the interval to the file
that `scripts/fake-nvidia-smi` reads) and waits for the step to end, like a CUDA
synchronize.  While the trainer is getting its next batch the GPU is idle, so whatever
delays the trainer shows up as GPU-idle time with one known cause.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import mmap
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

# One BLAS thread: hidden OpenBLAS threads would add CPU load nobody asked for.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

try:
    import numpy as np  # noqa: E402  (after the thread-count settings above)
except ImportError:  # another Python build, a container's (tests/container_env.py): none installed there
    np = None

SIM_GPU_ENV = "TRAINBPF_SIM_GPU"
DEFAULT_SIM_GPU_PATH = "/tmp/trainbpf-sim-gpu"
DATALOADER_COMM = "pt_data_worker"  # what torch names its DataLoader workers
# One GPU step, as real training has them (tens of ms; --step-ms changes it).  Each
# workload sizes its injected stall from it: about a step, so shorter than one GPU sample
# (100 ms nvidia-smi, 167 ms NVML), and the GPU is partly busy in every sample.
DEFAULT_STEP_S = 0.04
STEP_S = DEFAULT_STEP_S
# Where the background threads of the lock and reclaim scenarios run: away from the
# trainer, so that its stall is the injected one and not a wait for a core they hog.
BACKGROUND_CPUS = {1}

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Past this size the interval file is started afresh: only its tail is ever read.
_SIM_FILE_MAX_BYTES = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)

# --hold-until: the load starts once this file exists (see wait_for_go).
_hold_path: str | None = None
HOLD_TIMEOUT_S = 300


def sim_gpu_path() -> str:
    return os.environ.get(SIM_GPU_ENV) or DEFAULT_SIM_GPU_PATH


class SimGpu:
    """The simulated GPU: busy intervals appended as "start_ns end_ns" lines
    (CLOCK_MONOTONIC, the clock of time.monotonic_ns())."""

    def __init__(self, path: str | None = None):
        self.path = path or sim_gpu_path()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self._fd).st_size > _SIM_FILE_MAX_BYTES:
            os.ftruncate(self._fd, 0)
        # Like a CUDA context: nvidia-smi --query-compute-apps now lists this process.
        with open(self.path + ".pids", "a") as fh:
            if fh.tell() > 4096:  # earlier runs' pids: the stand-in skips dead ones anyway
                fh.truncate(0)
            fh.write(f"{os.getpid()}\n")
        self.created_ns = time.monotonic_ns()
        self.busy_ns = 0
        self.steps = 0

    def step(self, seconds: float) -> None:
        """Run one GPU step of `seconds` and wait for it to finish."""
        start = time.monotonic_ns()
        end = start + int(seconds * 1e9)
        # One write of one short line on an O_APPEND descriptor: readers never see half.
        os.write(self._fd, f"{start} {end}\n".encode())
        sleep_until_ns(end)
        self.busy_ns += end - start
        self.steps += 1


def sleep_until_ns(deadline_ns: int) -> None:
    while (left := deadline_ns - time.monotonic_ns()) > 0:
        time.sleep(left / 1e9)


def parse_args(description: str | None, add_arguments=None) -> argparse.Namespace:
    """The workload's command line (--seconds and what `add_arguments` adds); from here
    on SIGTERM ends the workload cleanly."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="how long to train once started (30)")
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_S * 1000,
                        help=f"length of one GPU step in ms ({DEFAULT_STEP_S * 1000:g}); the injected "
                        "stall scales with it")
    parser.add_argument("--hold-until", metavar="FILE",
                        help="create the threads at once but start the load only when FILE "
                        "exists (the scenario tests pass the recorder's spool file, so the "
                        "probes compile on an idle machine)")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if not 1 <= args.step_ms <= 10_000:
        parser.error("--step-ms must be between 1 and 10000")
    exit_on_sigterm()
    global _hold_path, STEP_S
    _hold_path = args.hold_until
    STEP_S = args.step_ms / 1000  # read by the workloads after parse_args
    return args


def wait_for_go() -> None:
    """Block until the --hold-until file exists (return at once without one).  Polls the
    file rather than an event, so forked worker processes can wait too."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while _hold_path is not None and not os.path.exists(_hold_path):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)


def release_hold() -> None:
    """Let held threads go (on the way out, so that they can see their stop flag)."""
    global _hold_path
    _hold_path = None


def run_main(main) -> None:
    """Run the workload's `main`, clean-ups included, then end the process at once:
    daemon threads may still be inside numpy, and finalising the interpreter under
    them can crash it."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def announce_ready() -> None:
    """The one line harnesses wait for: the workload's threads exist, trace it now."""
    print(f"ready pid={os.getpid()}", flush=True)


def exit_on_sigterm() -> None:
    """SIGTERM ends the workload through SystemExit, so `finally` clean-ups run."""

    def _exit(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)


def set_comm(name: str) -> None:
    """Name the calling thread in the kernel (its comm, 15 bytes at most)."""
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def die_with_parent() -> None:
    """A forked worker gets SIGTERM when the process that forked it exits."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_thread(name: str, target, *args, comm: str | None = None,
                 cpus: set[int] | None = None, held: bool = True) -> threading.Thread:
    """A daemon thread named `name` in Python and `comm` (default: name) in the kernel,
    pinned to `cpus` when given, running `target` once the workload may start
    (wait_for_go), or at once when not `held`."""

    def run():
        set_comm(comm or name)
        if cpus is not None:
            pin_current_thread(cpus)
        if held:
            wait_for_go()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def pin_current_thread(cpus: set[int]) -> None:
    os.sched_setaffinity(threading.get_native_id(), cpus)


# CPU work in chunks of single-threaded BLAS (a matrix product into a preallocated
# output).  Each chunk runs with the GIL released, so threads burning CPU this way
# compete for cores, not for the interpreter lock.
_DEFAULT_MATRIX_N = 256  # one product: about 1 ms


def burn_cpu(seconds: float, matrix_n: int = _DEFAULT_MATRIX_N) -> None:
    """Spend `seconds` of this thread's CPU time (not wall time: waiting for a core
    makes the work take longer, as real decoding would).  Bigger `matrix_n` means
    longer chunks (128: ~0.1 ms, 512: ~7 ms) and fewer trips through the GIL.  Without
    numpy, hashing chunks of 1 MiB, which also runs with the GIL released."""
    if np is None:
        _burn_cpu_hashing(seconds)
        return
    matrix = np.random.default_rng().random((matrix_n, matrix_n))
    out = np.empty_like(matrix)
    stop = time.thread_time() + seconds
    while time.thread_time() < stop:
        np.matmul(matrix, matrix, out=out)


def _burn_cpu_hashing(seconds: float) -> None:
    chunk = bytes(1 << 20)  # ~1 ms, as one default product; hashlib drops the GIL for buffers over 2 KiB
    stop = time.thread_time() + seconds
    while time.thread_time() < stop:
        hashlib.sha256(chunk).digest()


def repeat_for(seconds: float, action) -> int:
    """Call `action()` at least once and again until `seconds` of wall time have passed;
    how many times.  An injected stall sized in time, not work: as long on a slow disk or
    a fast CPU, so it stays shorter than one GPU sample on any machine."""
    deadline = time.monotonic() + seconds
    n = 0
    while True:
        action()
        n += 1
        if time.monotonic() >= deadline:
            return n


def touch_fresh_mapping(nbytes: int, *, huge_pages: bool = False) -> None:
    """Map `nbytes` of anonymous memory, fault in every page and unmap it again: what an
    allocator without pooling does for each block above its mmap threshold."""
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_NOHUGEPAGE)
    pages = np.frombuffer(buffer, dtype=np.uint8)
    pages[:: mmap.PAGESIZE] = 1  # one write per small page: every page faults in
    del pages  # the mapping cannot be closed while numpy still points into it
    buffer.close()  # munmap


def rewrite_file_forever(path: str, file_bytes: int, write_bytes: int,
                         stop: threading.Event, *, in_place: bool = False) -> None:
    """Write `path` again and again through the page cache (buffered, no fsync) until
    `stop` is set.  Rewriting one file (O_TRUNC) keeps disk use bounded; `in_place`
    overwrites it instead, so its cached pages are dirtied again, never freed."""
    chunk = bytes(write_bytes)
    while not stop.is_set():
        with open(path, "r+b" if in_place and os.path.exists(path) else "wb") as f:
            for _ in range(file_bytes // write_bytes):
                if stop.is_set():
                    return
                f.write(chunk)


@contextlib.contextmanager
def file_rewriters(name: str, paths: list[str], file_bytes: int, write_bytes: int, *,
                   cpus: set[int] | None = None, in_place: bool = False, held: bool = True):
    """Threads named `name`, one per path, running rewrite_file_forever (pinned to `cpus`
    when given; from the go on, or at once when not `held`); stopped and joined on exit
    (before anyone removes their folder, or they may recreate a file)."""
    stop = threading.Event()
    threads = []
    try:
        for path in paths:
            rewrite = functools.partial(rewrite_file_forever, in_place=in_place)
            threads.append(start_thread(name, rewrite, path, file_bytes, write_bytes, stop, cpus=cpus,
                                        held=held))
        yield threads
    finally:
        stop.set()
        release_hold()
        for thread in threads:
            thread.join()


@contextlib.contextmanager
def background_thread(name: str, target, *args, cpus: set[int] | None = None):
    """A thread named `name` running `target(*args, stop)` from the go on (pinned to
    `cpus` when given); `stop` set and the thread joined on exit."""
    stop = threading.Event()
    thread = start_thread(name, target, *args, stop, cpus=cpus)
    try:
        yield thread
    finally:
        stop.set()
        release_hold()
        thread.join()


def write_dataset(path: str, nbytes: int, *, cached: bool = True) -> None:
    """A dataset file of `nbytes` random bytes on disk before the go (fsync'd: none of
    its writeback later); not `cached`: its pages dropped from the page cache too."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        if not cached:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def add_dir_argument(parser) -> None:
    parser.add_argument("--dir", help="where to write scratch files (default /var/tmp); "
                        "they go into a fresh subfolder, removed at exit")


@contextlib.contextmanager
def scratch_folder(prefix: str, parent: str | None = None):
    """A fresh folder inside `parent`, removed with its files on exit.  /var/tmp by
    default, not /tmp: the point is a disk-backed file system, and /tmp may be tmpfs."""
    folder = tempfile.mkdtemp(prefix=prefix, dir=parent or "/var/tmp")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def decode_batch(cpu_seconds: float, batch_bytes: int = 1 << 20):
    """A stand-in for decoding one batch of samples: CPU work, then the batch tensor
    (bytes without numpy)."""
    burn_cpu(cpu_seconds)
    return bytes(batch_bytes) if np is None else np.ones(batch_bytes // 8, dtype=np.float64)


def train(seconds: float, next_batch=None, *, step_s=None, before_step=None) -> None:
    """Announce readiness, wait for the go (--hold-until), run the trainer loop for
    `seconds`, report on stderr.  Without `next_batch` batches are at hand at once.
    `step_s`: the GPU step's length, or a function giving each step's (default STEP_S)."""
    announce_ready()
    wait_for_go()
    report(run_trainer(seconds, next_batch or (lambda: None), step_s=step_s or STEP_S,
                       before_step=before_step))


def start_dataloader(index: int, batches, decode_cpu_s: float, *,
                     cpus: set[int] | None = None) -> threading.Thread:
    """A dataloader thread (comm pt_data_worker) that decodes batches forever into the
    queue `batches`, blocking while it is full; pinned to `cpus` when given."""

    def load() -> None:
        while True:
            batches.put(decode_batch(decode_cpu_s))

    return start_thread(f"{DATALOADER_COMM}_{index}", load, comm=DATALOADER_COMM, cpus=cpus)


def run_trainer(seconds: float, next_batch, *, step_s: float, before_step=None) -> SimGpu:
    """The trainer loop on the calling (main) thread: batch, GPU step, repeat.

    `before_step(batch)` is host work between getting the batch and launching the step
    (collate, copy to the device): it too leaves the GPU idle."""
    gpu = SimGpu()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = next_batch()
        if before_step is not None:
            before_step(batch)
        gpu.step(step_s() if callable(step_s) else step_s)
    return gpu


def report(gpu: SimGpu) -> None:
    """One summary line on stderr: how busy the workload kept its simulated GPU."""
    elapsed_ns = max(1, time.monotonic_ns() - gpu.created_ns)
    print(
        f"{os.path.basename(sys.argv[0])}: {gpu.steps} steps, "
        f"simulated GPU busy {gpu.busy_ns / elapsed_ns:.0%}",
        file=sys.stderr,
        flush=True,
    )
