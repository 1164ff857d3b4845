"""Lock contention on glibc's own allocator lock: four threads malloc and free in native
code all the time, and the trainer allocates its step's buffers through the same arena.

The allocation loop is a small C library (arena_churn.c, compiled with gcc at start)
called through ctypes, which lets go of the GIL.  The process runs with one arena
(MALLOC_ARENA_MAX=1) and no per-thread cache (GLIBC_TUNABLES=glibc.malloc.tcache_count=0):
it re-executes itself with them when they are missing, as glibc reads them only at
start.  Every malloc and free then takes main_arena's mutex, the first word of libc's
`main_arena`, the address the recorder names.  The churning threads share CPU 1, the trainer
has CPU 0.
Expected top finding: lock_contention, its lock named main_arena.
"""

import ctypes
import os
import sys
from pathlib import Path

ARENA_ENV = {"MALLOC_ARENA_MAX": "1", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
if any(os.environ.get(k) != v for k, v in ARENA_ENV.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ARENA_ENV})

import common  # noqa: E402  (after the re-execution above)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from standin_build import compile_library  # noqa: E402

N_CHURNERS = 3
TRAINER_CPUS = {0}
# A churner's batch: 16 MiB of buffers under the mmap threshold, so they come from the
# heap's top and the last free gives them back to the kernel with the lock held.
BATCH_BUFFER_BYTES = 64 << 10
BATCH_BUFFERS = 256
# The trainer allocates small buffers, above the fastbins (free takes the lock as malloc
# does), for this share of a step's time, lock waits included.
ALLOC_STEPS = 0.5
TRAINER_BUFFER_BYTES = 1024
TRAINER_BUFFERS = 16


def load_library(folder: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(compile_library(Path(folder) / "libarena_churn.so", [HERE / "arena_churn.c"],
                                          "-fno-omit-frame-pointer", what="allocation loop")))
    lib.arena_churn.argtypes = (ctypes.c_long, ctypes.c_size_t, ctypes.c_int)
    lib.arena_churn.restype = ctypes.c_long
    return lib


def churn_forever(lib: ctypes.CDLL) -> None:
    while True:
        lib.arena_churn(1, BATCH_BUFFER_BYTES, BATCH_BUFFERS)


def main() -> None:
    args = common.parse_args(__doc__)
    with common.scratch_folder("trainbpf-arena-") as folder:
        lib = load_library(folder)
        # The trainer keeps CPU 0: woken by a churner's unlock, it would otherwise be
        # pulled onto the churners' CPU and wait there for a CPU, not for the lock.
        common.pin_current_thread(TRAINER_CPUS)
        for i in range(N_CHURNERS):
            common.start_thread(f"churn_{i}", churn_forever, lib, cpus=common.BACKGROUND_CPUS)

        def allocate_step_buffers(batch) -> None:
            common.repeat_for(ALLOC_STEPS * common.STEP_S,
                              lambda: lib.arena_churn(1, TRAINER_BUFFER_BYTES, TRAINER_BUFFERS))

        common.train(args.seconds, before_step=allocate_step_buffers)


if __name__ == "__main__":
    common.run_main(main)
