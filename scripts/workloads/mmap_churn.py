"""Allocator churn on the critical path: for 60% of every step the trainer maps fresh
8 MiB anonymous buffers, touches every page and unmaps it again.

This is what an allocator with no pooling does for allocations above its mmap
threshold (glibc's is at most 32 MiB).  Each buffer pays 2 k minor page faults (page
zeroing included) plus an mmap/munmap pair while the GPU waits.
Expected top finding: allocator_churn (or page_faults).
"""

import common

BUFFER_BYTES = 8 << 20  # 2 k page faults a buffer
CHURN_STEPS = 0.6  # fresh buffers for this share of a step's time, every step


def fresh_buffer_per_step(batch) -> None:
    # Small pages, as a process without transparent huge pages gets: one fault per 4 KiB.
    common.repeat_for(CHURN_STEPS * common.STEP_S,
                      lambda: common.touch_fresh_mapping(BUFFER_BYTES, huge_pages=False))


def main() -> None:
    args = common.parse_args(__doc__)
    common.train(args.seconds, before_step=fresh_buffer_per_step)


if __name__ == "__main__":
    common.run_main(main)
