"""Healthy: one dataloader thread decodes far faster than the GPU consumes, batches are
prefetched into a queue, and the trainer always finds the next one waiting.  The
simulated GPU stays busy about 95 % of the time.
Expected: no critical finding.
"""

import queue

import common

DECODE_STEPS = 0.2  # a fifth of a step per batch: the queue stays full
PREFETCH = 4


def main() -> None:
    args = common.parse_args(__doc__)
    batches: queue.Queue = queue.Queue(maxsize=PREFETCH)
    common.start_dataloader(0, batches, DECODE_STEPS * common.STEP_S)
    common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
