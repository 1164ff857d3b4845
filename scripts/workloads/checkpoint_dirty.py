"""Dirty-page throttling: a background thread keeps writing a large checkpoint through
the page cache (buffered write(), no fsync) while the trainer appends each batch's rows
(8 MiB) to a spill file.

Under low dirty limits (the scenario test lowers vm.dirty_bytes and
vm.dirty_background_bytes for the run) every writer of the file system is paused in
balance_dirty_pages, the trainer included, although the checkpoint is "in the
background".
Expected top finding: dirty_throttling.
"""

import os

import common

CHECKPOINT_BYTES = 256 << 20
CHECKPOINT_WRITE_BYTES = 8 << 20
# More than the trainer's share of the disk's write bandwidth while the checkpoint
# runs, so the trainer is throttled too.
TRAINER_WRITE_BYTES = 64 << 20


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    with common.scratch_folder("trainbpf-ckpt-", args.dir) as folder, \
            common.file_rewriters("ckpt_writer", [os.path.join(folder, "checkpoint.bin")],
                                  CHECKPOINT_BYTES, CHECKPOINT_WRITE_BYTES), \
            open(os.path.join(folder, "spill.bin"), "wb") as spill:
        rows = bytes(TRAINER_WRITE_BYTES)

        def spill_batch(batch) -> None:
            if spill.tell() >= CHECKPOINT_BYTES:
                spill.seek(0)  # bounded disk use
            spill.write(rows)

        common.train(args.seconds, before_step=spill_batch)


if __name__ == "__main__":
    common.run_main(main)
