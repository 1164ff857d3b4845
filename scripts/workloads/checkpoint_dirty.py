"""Dirty-page throttling: a background thread keeps writing a large checkpoint through
the page cache (buffered write(), no fsync) while the trainer appends each batch's rows
to a spill file.

Under low dirty limits (the scenario test lowers vm.dirty_bytes and
vm.dirty_background_bytes for the run) every writer of the file system is paused in
balance_dirty_pages, the trainer included, although the checkpoint is "in the
background".  The checkpoint writer runs on CPU 1, leaving the trainer a core.
Expected top finding: dirty_throttling.
"""

import os

import common

CHECKPOINT_BYTES = 256 << 20
CHECKPOINT_WRITE_BYTES = 8 << 20
# The trainer spills rows in 256 KiB writes for 60% of every step's time: more than its
# share of the disk's write bandwidth while the checkpoint runs, so it is throttled too.
# Small writes: one write() is throttled until the dirty pages are back under the limit,
# however long that takes, so a large one could stall the trainer past a GPU sample.
TRAINER_WRITE_BYTES = 256 << 10
SPILL_STEPS = 0.6


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    with common.scratch_folder("trainbpf-ckpt-", args.dir) as folder, \
            common.file_rewriters("ckpt_writer", [os.path.join(folder, "checkpoint.bin")],
                                  CHECKPOINT_BYTES, CHECKPOINT_WRITE_BYTES,
                                  cpus=common.BACKGROUND_CPUS), \
            open(os.path.join(folder, "spill.bin"), "wb") as spill:
        rows = bytes(TRAINER_WRITE_BYTES)

        def spill_rows() -> None:
            if spill.tell() >= CHECKPOINT_BYTES:
                spill.seek(0)  # bounded disk use
            spill.write(rows)

        def spill_batch(batch) -> None:
            common.repeat_for(SPILL_STEPS * common.STEP_S, spill_rows)

        common.train(args.seconds, before_step=spill_batch)


if __name__ == "__main__":
    common.run_main(main)
