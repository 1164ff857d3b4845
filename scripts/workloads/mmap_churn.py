"""Allocator churn on the critical path: every step the trainer maps a fresh 384 MiB
anonymous buffer, touches every page and unmaps it again.

This is what an allocator with no pooling does for allocations above its mmap
threshold (glibc's is at most 32 MiB).  Each step pays 96 k minor page faults (page
zeroing included) plus an mmap/munmap pair while the GPU waits.
Expected top finding: allocator_churn (or page_faults).
"""

import common

BUFFER_BYTES = 384 << 20


def fresh_buffer_per_step(batch) -> None:
    # Small pages, as a process without transparent huge pages gets: one fault per 4 KiB.
    common.touch_fresh_mapping(BUFFER_BYTES, huge_pages=False)


def main() -> None:
    args = common.parse_args(__doc__)
    common.train(args.seconds, before_step=fresh_buffer_per_step)


if __name__ == "__main__":
    common.run_main(main)
