"""Host-bound, in plain Python: the trainer decodes its own batch (half a step of CPU)
before every GPU step; no other thread loads data.

The trainer never waits for another thread: it is busy on the CPU itself while the
simulated GPU idles.
Expected top finding: input_pipeline, with the trainer itself as the producer and
`decode_batch` named.
"""

import common

DECODE_STEPS = 0.5


def main() -> None:
    args = common.parse_args(__doc__)
    common.train(args.seconds, lambda: common.decode_batch(DECODE_STEPS * common.STEP_S))


if __name__ == "__main__":
    common.run_main(main)
