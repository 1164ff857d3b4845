"""Dirty-page throttling: a background thread keeps writing a large checkpoint through
the page cache (buffered write(), no fsync) while the trainer appends each batch's rows
to a spill file.

Under low dirty limits (the scenario test lowers vm.dirty_bytes and
vm.dirty_background_bytes for the run) every writer of the file system is paused in
balance_dirty_pages, the trainer included, although the checkpoint is "in the
background".  The checkpoint writer runs on CPU 1, leaving the trainer a core.  It
starts writing at once, not at the go: for its first second or two the kernel's
throttling has no estimate of the disk's write bandwidth yet and pauses writers 200 ms
at a time, longer than a GPU sample; a checkpoint already under way has none of that.
Expected top finding: dirty_throttling.
"""

import os

import common

CHECKPOINT_BYTES = 256 << 20
# 256 KiB writes, the trainer's too: the page cache takes a write in folios up to its
# size, and a folio of MiBs overshoots a dirty limit of 2 MiB at once.
CHECKPOINT_WRITE_BYTES = 256 << 10
# The trainer spills rows for 60% of every step's time: more than its share of the
# disk's write bandwidth while the checkpoint runs, so it is throttled too.
TRAINER_WRITE_BYTES = 256 << 10
SPILL_STEPS = 0.6


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    with common.scratch_folder("trainbpf-ckpt-", args.dir) as folder, \
            common.file_rewriters("ckpt_writer", [os.path.join(folder, "checkpoint.bin")],
                                  CHECKPOINT_BYTES, CHECKPOINT_WRITE_BYTES,
                                  cpus=common.BACKGROUND_CPUS, held=False), \
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
