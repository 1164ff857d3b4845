"""Starvation as real training shows it: the trainer waits for a dataloader thread for
about half of every step, inside steps of 30-60 ms, and the GPU is busy about 40% of
every sample.

Each step has its own length T (30-60 ms, varying from step to step): the trainer takes
a batch, collates it (0.1 T of CPU) and runs the GPU for 0.4 T.  The one dataloader
thread needs T of CPU for the batch of a T step, so the trainer waits about 0.5 T for
every batch.  No wait is longer than a GPU sample: a model that counts starvation only
in idle samples sees nothing here.
Expected top finding: input_pipeline, starved at least 40% of the time.
"""

import queue
import random

import common

STEP_RANGE = (0.75, 1.5)  # step lengths as multiples of --step-ms (30-60 ms at 40)
COLLATE_SHARE = 0.1
GPU_SHARE = 0.4


def main() -> None:
    args = common.parse_args(__doc__)
    rng = random.Random(7)  # the same sequence of step lengths every run
    batches: queue.Queue = queue.Queue(maxsize=1)

    def load() -> None:
        while True:
            step = rng.uniform(*STEP_RANGE) * common.STEP_S
            batches.put((step, common.decode_batch(step)))

    common.start_thread(f"{common.DATALOADER_COMM}_0", load, comm=common.DATALOADER_COMM)
    current = {"step": common.STEP_S}  # the length of the step whose batch is in hand

    def next_batch():
        current["step"], batch = batches.get()
        return batch

    def collate(batch) -> None:
        common.burn_cpu(COLLATE_SHARE * current["step"])

    common.train(args.seconds, next_batch, before_step=collate, step_s=lambda: GPU_SHARE * current["step"])


if __name__ == "__main__":
    common.run_main(main)
