"""The standard trainer workload of bench_overhead.py: a fixed number of training steps
fed by dataloader threads that decode batches with numpy, with a buffered checkpoint
write every few steps.  Stdlib + numpy only.

Threads start at once and wait; the steps start when a line arrives on stdin (so a
tracer can attach first).  Prints one JSON line: the wall time of the steps alone.

    python trainer_steps.py [--steps 600] [--workers 2] [--checkpoint-every 200] [--unmapper]

--unmapper adds a thread that, while the steps run, maps a fresh UNMAP_KIB buffer, writes
it (every page faults in) and unmaps it, in a loop with UNMAP_PAUSE_S between rounds: each
munmap flushes the TLBs of the other CPUs the process runs on (TLB shootdowns, the tlb
probe's events).
"""

from __future__ import annotations

import os

# One BLAS thread: the "model" stands in for work on a GPU, not for a CPU-parallel job.
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import argparse  # noqa: E402
import mmap  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

BATCH = 64
IMAGE = (3, 64, 64)
HIDDEN = 64
UNMAP_KIB = 256
UNMAP_PAUSE_S = 0.0005


def encoded_batches(n: int, seed: int) -> list[bytes]:
    """Stand-ins for compressed samples on disk: raw bytes the workers decode."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BATCH * int(np.prod(IMAGE)), dtype=np.uint8).tobytes() for _ in range(n)]


def decode(raw: bytes, rng: np.random.Generator) -> np.ndarray:
    """Bytes -> normalised float batch with a random flip and crop-and-pad."""
    x = np.frombuffer(raw, dtype=np.uint8).reshape(BATCH, *IMAGE).astype(np.float32)
    x = (x / 255.0 - 0.5) / 0.25
    if rng.random() < 0.5:
        x = x[..., ::-1]
    shift = int(rng.integers(-4, 5))
    x = np.roll(x, shift, axis=-1)
    return np.ascontiguousarray(x.reshape(BATCH, -1))


def unmapper(start: threading.Event, stop: threading.Event) -> None:
    """Map, fill and unmap a fresh buffer, again and again, until `stop`."""
    fill = b"\1" * (UNMAP_KIB << 10)
    start.wait()
    while not stop.is_set():
        m = mmap.mmap(-1, len(fill), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.write(fill)
        m.close()  # munmap
        time.sleep(UNMAP_PAUSE_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workers", type=int, default=2, help="dataloader threads")
    ap.add_argument("--checkpoint-every", type=int, default=200)
    ap.add_argument("--checkpoint-mb", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder)")
    ap.add_argument("--no-wait", action="store_true", help="start at once, without waiting for stdin")
    ap.add_argument("--unmapper", action="store_true", help="a thread unmapping fresh buffers in a loop")
    ap.add_argument("--hold", action="store_true",
                    help="after printing the result, wait for stdin to close before exiting "
                         "(so a tracer's figures can be read while it still traces)")
    args = ap.parse_args()

    samples = encoded_batches(8, seed=1)
    batches: queue.Queue = queue.Queue(maxsize=4)
    start = threading.Event()
    stop = threading.Event()

    def worker(i: int) -> None:
        rng = np.random.default_rng(100 + i)
        start.wait()
        n = i
        while not stop.is_set():
            batch = decode(samples[n % len(samples)], rng)
            n += args.workers
            while not stop.is_set():
                try:
                    batches.put(batch, timeout=0.1)
                    break
                except queue.Full:
                    pass

    workers = [threading.Thread(target=worker, args=(i,), name=f"data_worker{i}", daemon=True)
               for i in range(args.workers)]
    if args.unmapper:
        workers.append(threading.Thread(target=unmapper, args=(start, stop), name="unmapper", daemon=True))
    for t in workers:
        t.start()
    rng = np.random.default_rng(7)
    features = int(np.prod(IMAGE))
    w1 = rng.standard_normal((features, HIDDEN), dtype=np.float32) * 0.01
    w2 = rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32) * 0.01
    state = rng.standard_normal(args.checkpoint_mb * 2**20 // 4, dtype=np.float32)  # optimizer state

    ckpt_dir = args.dir or tempfile.mkdtemp(prefix="trainer-steps-")
    if not args.no_wait:
        sys.stdin.readline()
    t0 = time.perf_counter()
    start.set()
    for step in range(args.steps):
        x = batches.get()
        h = np.maximum(x @ w1, 0.0)  # forward
        y = h @ w2
        grad = h.T @ (y / len(y))  # backward, of sorts
        w2 -= 1e-4 * grad
        if (step + 1) % args.checkpoint_every == 0:
            path = os.path.join(ckpt_dir, "checkpoint.bin")
            with open(path, "wb") as f:  # buffered: lands in the page cache
                f.write(w1.tobytes())
                f.write(w2.tobytes())
                f.write(state.tobytes())
            os.unlink(path)
    wall = time.perf_counter() - t0
    stop.set()
    for t in workers:
        t.join()
    if not args.dir:
        os.rmdir(ckpt_dir)
    print(json.dumps({"wall_s": wall, "steps": args.steps}), flush=True)
    if args.hold:
        sys.stdin.read()


if __name__ == "__main__":
    main()
