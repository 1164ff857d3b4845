"""CPU contention: batches are ready at once, but eight busy "augmentation" threads in
the same process oversubscribe the machine's cores.

The trainer's own host work per step (collating the batch) is small, yet it spends most
of the time between GPU steps runnable but not running, queued behind the augmenters.
Expected top finding: cpu_contention.
"""

import itertools

import common

COLLATE_STEPS = 0.25  # a quarter of a step: alone on a core this leaves the GPU ~80 % busy
N_AUGMENTERS = 8
# Long GIL-free chunks (~50 ms for the augmenters, ~1 ms for the trainer): the threads
# seldom need the interpreter lock, so the trainer waits for a core, not for the GIL.
AUGMENT_MATRIX_N = 1024
COLLATE_MATRIX_N = 256


def augment_forever() -> None:
    while True:
        common.burn_cpu(1.0, matrix_n=AUGMENT_MATRIX_N)


def collate(batch) -> None:
    common.burn_cpu(COLLATE_STEPS * common.STEP_S, matrix_n=COLLATE_MATRIX_N)


def main() -> None:
    args = common.parse_args(__doc__)
    for i in range(N_AUGMENTERS):
        common.start_thread(f"augment_{i}", augment_forever)
    # A dataset already in memory: getting the next batch costs nothing.
    cached = [common.np.ones(1 << 17) for _ in range(4)]
    common.train(args.seconds, itertools.cycle(cached).__next__, before_step=collate)


if __name__ == "__main__":
    common.run_main(main)
