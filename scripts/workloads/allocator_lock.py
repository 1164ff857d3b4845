"""Lock contention: six threads hammer one allocator lock that the trainer must also
take for every tensor it allocates.

The lock is a real pthread mutex (called through ctypes, which releases the GIL): it
stands for a malloc arena lock held while the allocator carves and zeroes a chunk.  The
trainer's waits are futex waits on the mutex's address, shared by many waiters, with
the user stack in pthread_mutex_lock.  The hammering threads share CPU 1, leaving the
trainer a core: unpinned, their GIL and wake-up traffic kept the trainer waiting for a
CPU for about a third of its stalls.
Expected top finding: lock_contention.
"""

import ctypes

import common

ALLOC_STEPS = 0.3  # the trainer allocates for this share of a step's time, lock waits included
N_HAMMERS = 6
CHUNK_BYTES = 4 << 20  # zeroing this under the lock holds it well under a ms

libc = ctypes.CDLL(None, use_errno=True)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
libc.memset.restype = ctypes.c_void_p


class ArenaLock:
    """A process-private pthread mutex; zeroed memory is PTHREAD_MUTEX_INITIALIZER."""

    def __init__(self):
        self._mutex = ctypes.create_string_buffer(64)  # >= sizeof(pthread_mutex_t)

    def allocate(self, chunk) -> None:
        """Carve and zero one chunk with the lock held."""
        libc.pthread_mutex_lock(self._mutex)
        try:
            libc.memset(ctypes.addressof(chunk), 0, len(chunk))
        finally:
            libc.pthread_mutex_unlock(self._mutex)


def hammer(arena: ArenaLock) -> None:
    chunk = ctypes.create_string_buffer(CHUNK_BYTES)  # touched once here: no faults later
    own = ctypes.create_string_buffer(CHUNK_BYTES)
    while True:
        arena.allocate(chunk)
        # As much work outside the lock: held about half the time, so one wait of the
        # trainer's is a hold or two, never long enough to idle a whole GPU sample.
        libc.memset(ctypes.addressof(own), 0, len(own))


def main() -> None:
    args = common.parse_args(__doc__)
    arena = ArenaLock()
    for i in range(N_HAMMERS):
        common.start_thread(f"alloc_{i}", hammer, arena, cpus=common.BACKGROUND_CPUS)
    trainer_chunk = ctypes.create_string_buffer(CHUNK_BYTES)

    def allocate_step_tensors(batch) -> None:
        common.repeat_for(ALLOC_STEPS * common.STEP_S, lambda: arena.allocate(trainer_chunk))

    common.train(args.seconds, before_step=allocate_step_tensors)


if __name__ == "__main__":
    common.run_main(main)
