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

ALLOCS_PER_STEP = 48
N_HAMMERS = 6
CHUNK_BYTES = 16 << 20  # zeroing this under the lock holds it about 1 ms

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
    while True:
        arena.allocate(chunk)


def main() -> None:
    args = common.parse_args(__doc__)
    arena = ArenaLock()
    for i in range(N_HAMMERS):
        common.start_thread(f"alloc_{i}", hammer, arena, cpus=common.BACKGROUND_CPUS)
    trainer_chunk = ctypes.create_string_buffer(CHUNK_BYTES)

    def allocate_step_tensors(batch) -> None:
        for _ in range(ALLOCS_PER_STEP):
            arena.allocate(trainer_chunk)

    common.train(args.seconds, before_step=allocate_step_tensors)


if __name__ == "__main__":
    common.run_main(main)
