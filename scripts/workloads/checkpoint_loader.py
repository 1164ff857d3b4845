"""Disk culprit: a background thread rewrites a checkpoint through the page cache while a
dataloader thread reads the dataset from the same disk with O_DIRECT, and the trainer
waits for the loader's batches.

The loader's reads queue behind the checkpoint's writeback (the scenario test lowers
vm.dirty_bytes and vm.dirty_background_bytes so that the flusher writes all along).  The
loader is the victim; the culprit is the checkpoint file and the thread that dirties it
(comm ckpt_writer); `--direct-checkpoint` writes the checkpoint with O_DIRECT instead, so
there is no writeback and the writer's own requests fill the disk.
Expected top finding: block_io, naming checkpoint.bin and ckpt_writer.
"""

import mmap
import os
import queue
import threading

import common

CHECKPOINT_BYTES = 256 << 20
CHECKPOINT_WRITE_BYTES = 256 << 10
# O_DIRECT writes go to the disk as they are: 8 MiB ones fill its queue as the page
# cache's writeback does (256 KiB ones, one at a time, hardly slow the reads).
DIRECT_WRITE_BYTES = 8 << 20
DATASET_BYTES = 64 << 20
# One batch: 96 MiB read with O_DIRECT (never from the page cache) 1 MiB at a time, a
# little decoding.  Alone on this machine's disk a batch takes most of a step; behind
# the checkpoint's writeback, two to six steps (with half as much, some runs' writeback
# slowed the loader by less than the step's slack and barely starved the GPU).
BATCH_BYTES = 96 << 20
# Behind the O_DIRECT checkpoint's 8 MiB writes a 96 MiB batch stalled the trainer for
# longer than a 167 ms NVML sample, leaving whole samples idle: half as much keeps the
# starvation at step scale and the disk's queue still the cause.
DIRECT_BATCH_BYTES = 48 << 20
READ_BYTES = 1 << 20
DECODE_STEPS = 0.05


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer, as O_DIRECT needs."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def load_forever(path: str, batches: queue.Queue, batch_bytes: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = _aligned(READ_BYTES)
    offset = 0
    while True:
        for _ in range(batch_bytes // READ_BYTES):
            os.preadv(fd, [buffer], offset)
            offset = (offset + READ_BYTES) % DATASET_BYTES
        batches.put(common.decode_batch(DECODE_STEPS * common.STEP_S, batch_bytes=1 << 16))


def write_direct_forever(path: str, stop: threading.Event) -> None:
    """The checkpoint written with O_DIRECT, again and again, in place."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    buffer = _aligned(DIRECT_WRITE_BYTES)
    try:
        while not stop.is_set():
            for offset in range(0, CHECKPOINT_BYTES, DIRECT_WRITE_BYTES):
                if stop.is_set():
                    return
                os.pwritev(fd, [buffer], offset)
    finally:
        os.close(fd)


def _arguments(parser) -> None:
    common.add_dir_argument(parser)
    parser.add_argument("--direct-checkpoint", action="store_true",
                        help="write the checkpoint with O_DIRECT instead of through the page cache")


def main() -> None:
    args = common.parse_args(__doc__, _arguments)
    with common.scratch_folder("trainbpf-ckptload-", args.dir) as folder:
        dataset, checkpoint = os.path.join(folder, "dataset.bin"), os.path.join(folder, "checkpoint.bin")
        common.write_dataset(dataset, DATASET_BYTES)
        batches: queue.Queue = queue.Queue(maxsize=2)
        common.start_thread(common.DATALOADER_COMM, load_forever, dataset, batches,
                            DIRECT_BATCH_BYTES if args.direct_checkpoint else BATCH_BYTES)
        if args.direct_checkpoint:
            with common.background_thread("ckpt_writer", write_direct_forever, checkpoint, cpus=common.BACKGROUND_CPUS):
                common.train(args.seconds, batches.get)
            return
        # Rewritten in place: its pages are dirtied again and written back all along (a
        # truncation would free them and, on a file system mounted with discard, send the
        # disk discards instead of writes while it runs).
        with common.file_rewriters("ckpt_writer", [checkpoint], CHECKPOINT_BYTES, CHECKPOINT_WRITE_BYTES,
                                   cpus=common.BACKGROUND_CPUS, in_place=True):
            common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
