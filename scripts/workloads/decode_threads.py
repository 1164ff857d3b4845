"""Input-pipeline bound: two dataloader threads decode batches slower than the GPU
consumes them.

The trainer waits in queue.Queue.get() (a futex wait on the queue's lock) and is woken
by the worker that was on-CPU decoding until it handed the batch over.
Expected top finding: input_pipeline.
"""

import queue

import common

# CPU time per batch per worker, in GPU steps: two workers deliver two batches every
# four steps' time, enough for two steps, so the trainer waits about a step for every
# batch and the GPU idles about half of every sample.
DECODE_STEPS = 4
N_WORKERS = 2


def main() -> None:
    args = common.parse_args(__doc__)
    batches: queue.Queue = queue.Queue(maxsize=2)
    for i in range(N_WORKERS):
        common.start_dataloader(i, batches, DECODE_STEPS * common.STEP_S)
    common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
