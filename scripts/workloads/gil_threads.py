"""GIL contention: the trainer's collate step is pure Python, and three metrics threads
in the same process crunch pure Python all the time.

Batches are at hand at once and every thread has CPU to spare (the metrics threads
share CPU 1, the trainer has CPU 0), yet collating takes several times its CPU cost:
the trainer waits for the interpreter lock, which the metrics threads hand round in
5 ms slices.  Its waits are futex waits on the GIL inside the interpreter's
`_PyRuntime`, the address the recorder names.
Expected top finding: gil_contention.
"""

import itertools
import time

import common

COLLATE_STEPS = 0.6  # pure Python, 60% of a step alone; waiting for the GIL doubles that
N_METRICS_THREADS = 3


def pure_python_for(seconds: float) -> int:
    """Interpreter work that never lets go of the GIL by itself."""
    deadline = time.thread_time() + seconds
    n = 0
    while time.thread_time() < deadline:
        for i in range(2000):
            n = (n * 31 + i) % 1_000_003
    return n


def metrics_forever() -> None:
    while True:
        pure_python_for(1.0)


def collate(batch) -> None:
    pure_python_for(COLLATE_STEPS * common.STEP_S)


def main() -> None:
    args = common.parse_args(__doc__)
    for i in range(N_METRICS_THREADS):
        common.start_thread(f"metrics_{i}", metrics_forever, cpus=common.BACKGROUND_CPUS)
    cached = [common.np.ones(1 << 17) for _ in range(4)]
    common.train(args.seconds, itertools.cycle(cached).__next__, before_step=collate)


if __name__ == "__main__":
    common.run_main(main)
