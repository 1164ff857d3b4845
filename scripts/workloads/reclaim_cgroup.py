"""Memory reclaim: run inside a memory-limited cgroup (the scenario test makes one of
256 MiB), three shard-writer threads keep the cgroup's page cache full of dirty pages
while the trainer appends rows to a spill file for half of every step.

At the limit every page of page cache the trainer writes must first be won back from
the cgroup's cache, so the trainer runs memcg reclaim itself, on the critical path; as
most of that cache is dirty, reclaim is slow (it must wait for writeback).  The trainer
writes files rather than faulting in fresh anonymous memory: a fresh page is zeroed in
the fault, and that zeroing cost about as much as the reclaim, making page faults a
second cause; written page cache is copied into, not zeroed.  Its writing is sized in
time, so a slow disk does not stretch a step's stall past a GPU sample.  The shards are
written once before the workload says it is ready, so the cgroup is at its limit when
the recording starts, and rewritten in place, so their pages are dirtied again rather
than freed (truncating would hand the trainer free room).  The writers share CPU 1,
leaving the trainer a core.  Outside a limited cgroup this workload only writes.
Expected top finding: memory_reclaim.
"""

import os

import common

SPILL_WRITE_BYTES = 1 << 20
SPILL_BYTES = 1 << 30  # the spill file wraps here: bounded disk use
SPILL_STEPS = 0.5  # the trainer spills for this share of a step's time, every step
N_WRITERS = 3
SHARD_BYTES = 128 << 20  # three shards: more than the cgroup's 256 MiB
SHARD_WRITE_BYTES = 8 << 20


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    with common.scratch_folder("trainbpf-shards-", args.dir) as folder:
        shards = [os.path.join(folder, f"shard{i}.bin") for i in range(N_WRITERS)]
        chunk = bytes(SHARD_WRITE_BYTES)
        for path in shards:  # fill the cgroup up to its limit before the recording
            with open(path, "wb") as f:
                for _ in range(SHARD_BYTES // SHARD_WRITE_BYTES):
                    f.write(chunk)
        rows = bytes(SPILL_WRITE_BYTES)
        with common.file_rewriters("shard_writer", shards, SHARD_BYTES, SHARD_WRITE_BYTES,
                                   cpus=common.BACKGROUND_CPUS, in_place=True), \
                open(os.path.join(folder, "spill.bin"), "wb") as spill:

            def spill_rows() -> None:
                if spill.tell() >= SPILL_BYTES:
                    spill.seek(0)
                spill.write(rows)

            common.train(args.seconds, before_step=lambda batch: common.repeat_for(SPILL_STEPS * common.STEP_S, spill_rows))


if __name__ == "__main__":
    common.run_main(main)
