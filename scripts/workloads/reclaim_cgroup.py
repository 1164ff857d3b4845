"""Memory reclaim: run inside a memory-limited cgroup (the scenario test makes one of
384 MiB), three shard-writer threads fill the cgroup's page cache with dirty pages
while the trainer maps and touches a fresh 32 MiB buffer every step.

At the limit every page the trainer faults in must first be won back from the page
cache, so the trainer runs memcg reclaim itself, on the critical path; as most of that
cache is dirty or under writeback, reclaim waits for the disk (and is throttled).
Clean page cache would not do: it is reclaimed so cheaply (well under a microsecond a
page) that the page faults themselves would cost more.  The trainer's buffer uses
transparent huge pages, so it takes 16 faults a step, not 8 k: the stall is reclaim,
not fault handling.  The writers share CPU 1, leaving the trainer a core: unpinned,
they kept it waiting for a CPU for about as long as it spent in reclaim.  Outside a
limited cgroup this workload only writes and allocates.
Expected top finding: memory_reclaim.
"""

import os

import common

BUFFER_BYTES = 256 << 20
N_WRITERS = 3
SHARD_BYTES = 512 << 20
SHARD_WRITE_BYTES = 8 << 20


def fresh_buffer_per_step(batch) -> None:
    common.touch_fresh_mapping(BUFFER_BYTES, huge_pages=True)


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    with common.scratch_folder("trainbpf-shards-", args.dir) as folder:
        shards = [os.path.join(folder, f"shard{i}.bin") for i in range(N_WRITERS)]
        with common.file_rewriters("shard_writer", shards, SHARD_BYTES, SHARD_WRITE_BYTES,
                                   cpus=common.BACKGROUND_CPUS):
            common.train(args.seconds, before_step=fresh_buffer_per_step)


if __name__ == "__main__":
    common.run_main(main)
