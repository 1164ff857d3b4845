"""A small training loop with known Python functions, run under each CPython version by
tests/test_pyframes.py.  The trainer (main thread) waits in `train_step` for a batch with
the GIL released; a dataloader thread asks a forked worker process for a sample and
reads it in `decode_batch` (GIL released while it reads), then decodes it (pure Python,
holding the GIL); the worker computes each sample in `produce_sample` when asked.  The
worker and the loader take turns, so at most two threads want a CPU (the trainer's
own work is small): the trainer waits for data, not for a CPU, on two CPUs.  The lines the test
looks for carry a `# line: NAME` marker.  Protocol as tests/kernel_workloads.py: prints
"ready", waits for "go" on stdin, runs SECONDS, prints the ids as JSON."""

import json
import os
import queue
import sys
import threading
import time

STEP_COMPUTE_S = 0.004  # the trainer's own work a step: the loader is the bottleneck
DECODE_ITERATIONS = 250_000  # ~12-20 ms of pure Python a batch, by interpreter
SAMPLE_ITERATIONS = 150_000  # ~7-12 ms a sample


def produce_sample(n):
    total = 0
    for i in range(n): total += i * i  # line: produce
    return total


def worker_main(ask_fd, write_fd, end):
    while time.monotonic() < end and os.read(ask_fd, 1):
        value = produce_sample(SAMPLE_ITERATIONS)
        os.write(write_fd, value.to_bytes(16, "little"))
    os._exit(0)


def decode_batch(ask_fd, read_fd, n):
    os.write(ask_fd, b"?")
    raw = os.read(read_fd, 16)  # line: read
    if not raw:
        return None
    total = int.from_bytes(raw, "little")
    for i in range(n): total ^= i * 7  # line: decode
    return total


def loader_main(ask_fd, read_fd, batches):
    while True:
        try:
            batch = decode_batch(ask_fd, read_fd, DECODE_ITERATIONS)
        except OSError:  # the trainer is done and closed the asking pipe
            return
        if batch is None:
            return
        batches.put(batch)


class Trainer:
    def __init__(self, batches):
        self.batches = batches

    def train_step(self):
        batch = self.batches.get(timeout=5)  # line: wait
        end = time.perf_counter() + STEP_COMPUTE_S
        while time.perf_counter() < end:
            pass
        return batch


def main(seconds):
    print("ready", flush=True)
    sys.stdin.readline()
    end = time.monotonic() + seconds
    read_fd, write_fd = os.pipe()
    ask_read, ask_fd = os.pipe()
    worker = os.fork()  # after "go": the recorder must find a process born while it records
    if worker == 0:
        os.close(read_fd)
        os.close(ask_fd)
        worker_main(ask_read, write_fd, end)
    os.close(write_fd)
    os.close(ask_read)
    batches = queue.Queue(maxsize=2)
    ids = {}
    loader = threading.Thread(target=lambda: (ids.__setitem__("loader", threading.get_native_id()),
                                              loader_main(ask_fd, read_fd, batches)), daemon=True)
    loader.start()
    trainer = Trainer(batches)
    while time.monotonic() < end:
        try:
            trainer.train_step()
        except queue.Empty:
            break
    os.close(ask_fd)  # the worker's read ends, and so does it
    os.waitpid(worker, 0)
    print(json.dumps({"trainer": threading.get_native_id(), "worker": worker, **ids}), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
