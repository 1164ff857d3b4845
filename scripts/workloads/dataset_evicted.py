"""Page cache refaults: inside a memory-limited cgroup (the scenario test makes one of 256
MiB) a dataloader thread reads a 160 MiB dataset through the page cache, an epoch after
another, while a checkpoint thread writes a new 128 MiB checkpoint file after another
and keeps the last three (as a trainer keeping its last checkpoints does).

Each epoch reads a page once, so the dataset's pages are no more used than the
checkpoints' fresh ones; the cgroup cannot hold both, and reclaim drops the dataset's
pages for the checkpoints': the next epoch reads them from the disk again.  The trainer
waits for the loader.  Expected: a block_io finding that names dataset.bin as read again
after the page cache dropped it for a checkpoint file written by ckpt_writer (the
loader's own reclaim, memory_reclaim, may come first).
"""

import os
import queue
import threading

import common

DATASET_BYTES = 160 << 20
CHECKPOINT_BYTES = 128 << 20
CHECKPOINTS_KEPT = 3
READ_BYTES = 4 << 20
# One batch: 96 MiB read through the page cache, a little decoding.  From the cache it
# takes a few ms; from this machine's disk about two steps.
BATCH_BYTES = 96 << 20
DECODE_STEPS = 0.05


def load_forever(path: str, batches) -> None:
    fd = os.open(path, os.O_RDONLY)
    offset = 0
    while True:
        for _ in range(BATCH_BYTES // READ_BYTES):
            os.pread(fd, READ_BYTES, offset)
            offset = (offset + READ_BYTES) % DATASET_BYTES
        batches.put(common.decode_batch(DECODE_STEPS * common.STEP_S, batch_bytes=1 << 16))


def checkpoint_forever(folder: str, stop: threading.Event) -> None:
    """checkpoint-0.pt, -1, -2, then -0 again (its old pages go with the truncation)."""
    chunk = bytes(1 << 20)
    n = 0
    while not stop.is_set():
        with open(os.path.join(folder, f"checkpoint-{n % CHECKPOINTS_KEPT}.pt"), "wb") as f:
            for _ in range(CHECKPOINT_BYTES >> 20):
                if stop.is_set():
                    return
                f.write(chunk)
        n += 1


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    with common.scratch_folder("trainbpf-evict-", args.dir) as folder:
        dataset = os.path.join(folder, "dataset.bin")
        # On disk before the go and not in the page cache: its pages enter the cache as
        # the loader reads them.
        common.write_dataset(dataset, DATASET_BYTES, cached=False)
        batches: queue.Queue = queue.Queue(maxsize=2)
        common.start_thread(common.DATALOADER_COMM, load_forever, dataset, batches)
        with common.background_thread("ckpt_writer", checkpoint_forever, folder, cpus=common.BACKGROUND_CPUS):
            common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
