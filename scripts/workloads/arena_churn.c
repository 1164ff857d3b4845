/* malloc and free in a loop, the way a native extension allocates and fills its buffers.
 * Each call takes the arena's lock while it carves a chunk or takes one back; freeing
 * the last of a batch returns the heap's free top to the kernel (glibc trims it, brk)
 * with the lock still held.  With one arena (MALLOC_ARENA_MAX=1) and no per-thread
 * cache (glibc.malloc.tcache_count=0), every thread calling this queues on main_arena's
 * mutex.  Called through ctypes, which lets go of the GIL, so the waits are on the
 * arena, never on the interpreter. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HELD 1024 /* chunks alive at once */

/* `rounds` times: allocate `count` chunks of `size` bytes, fill each, and free them in
 * the order they were made; the number of chunks allocated. */
long arena_churn(long rounds, size_t size, int count)
{
    void *held[MAX_HELD];
    long made = 0;
    if (count > MAX_HELD)
        count = MAX_HELD;
    for (long r = 0; r < rounds; r++) {
        for (int i = 0; i < count; i++) {
            held[i] = malloc(size);
            if (held[i] != NULL) {
                memset(held[i], i, size);
                made++;
            }
        }
        for (int i = 0; i < count; i++)
            free(held[i]);
    }
    return made;
}
