"""Host-bound, with torch's own DataLoader and its default num_workers=0: every batch is
decoded in `__getitem__` (decode_torch's dataset) on the trainer's own thread, between
GPU steps.

The trainer never waits for another thread: it is busy on the CPU itself while the
simulated GPU idles.  Needs torch (a CPU build is enough).
Expected top finding: input_pipeline, with the trainer itself as the producer and
`__getitem__` named.
"""

import common
import torch
from decode_torch import BATCH_SIZE, SlowDecodeDataset
from torch.utils.data import DataLoader

# Decode time per batch, in GPU steps: the GPU idles about as long as it works.
DECODE_STEPS = 0.9


def main() -> None:
    args = common.parse_args(__doc__)
    torch.set_num_threads(1)
    loader = DataLoader(SlowDecodeDataset(DECODE_STEPS), batch_size=BATCH_SIZE)  # num_workers=0: the default
    common.train(args.seconds, iter(loader).__next__)


if __name__ == "__main__":
    common.run_main(main)
