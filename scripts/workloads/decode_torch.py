"""Input-pipeline bound, with torch's own DataLoader: two worker processes
(num_workers=2; torch names them pt_data_worker) decode samples slower than the GPU
consumes batches.

The trainer blocks on the DataLoader's result queue and is woken through the queue's
pipe by the worker process's feeder thread, which the decoding worker thread woke:
a two-hop chain to a worker that was on-CPU.  Needs torch (a CPU build is enough).
Expected top finding: input_pipeline.
"""

import common
import torch
from torch.utils.data import DataLoader, Dataset

BATCH_SIZE = 8
# Decode time per batch per worker, in GPU steps (an eighth of it per sample): two
# workers, 2.5 steps each, so the trainer waits about a quarter of a step for every
# batch, plus torch's own per-batch work (collating, the result queue).
DECODE_STEPS = 2.5
SAMPLE_ELEMENTS = 1 << 15


class SlowDecodeDataset(Dataset):
    """Samples that take `decode_steps` GPU steps of CPU per batch of BATCH_SIZE to decode."""

    def __init__(self, decode_steps: float = DECODE_STEPS):
        self.decode_steps = decode_steps

    def __len__(self) -> int:
        return 1 << 30  # never exhausted within a run

    def __getitem__(self, index: int) -> torch.Tensor:
        common.burn_cpu(self.decode_steps * common.STEP_S / BATCH_SIZE)
        return torch.ones(SAMPLE_ELEMENTS)


def hold_worker(worker_id: int) -> None:
    common.wait_for_go()


def main() -> None:
    args = common.parse_args(__doc__)
    loader = DataLoader(SlowDecodeDataset(), batch_size=BATCH_SIZE, num_workers=2,
                        prefetch_factor=2, worker_init_fn=hold_worker)
    batches = iter(loader)  # starts the worker processes before we announce readiness
    common.train(args.seconds, batches.__next__)


if __name__ == "__main__":
    common.run_main(main)
