/* Shared by every probe: the traced-thread set, lost-event counters and the stack map.
 *
 * Probes read only tracepoint fields and stable helpers, never kernel struct layouts
 * from headers: bcc compiles against whatever headers are at hand (often older than the
 * running kernel), and a struct read through mismatched headers returns garbage (the
 * net probe takes its few offsets from the running kernel's BTF instead).
 * Settings and sizes arrive as -D defines from the loader (tracer/settings.py Settings,
 * tracer/loader.py cflags); there are no defaults here, a missing one stops the build. */
#ifndef TRAINBPF_COMMON_H
#define TRAINBPF_COMMON_H

#include <uapi/linux/ptrace.h>

/* Threads traced at once: the size of every per-thread map (tracer/loader.py). */
#ifndef MAX_THREADS
#error "MAX_THREADS must be defined by the loader"
#endif
/* Stacks: frames kept per stack and map entries (Settings.stack_frames, stack_entries).
 * The kernel walks no deeper than the map's value holds, so 32 frames instead of bcc's
 * 127 make every walk shorter and, in the same ~17 MB of preallocated kernel memory,
 * give four times the entries: ids are never reused, so a stack whose hash lands on an
 * occupied bucket is lost (-EEXIST) for the whole recording, and fewer stacks collide. */
#ifndef STACK_FRAMES
#error "STACK_FRAMES must be defined by the loader"
#endif
#ifndef STACK_ENTRIES
#error "STACK_ENTRIES must be defined by the loader"
#endif
/* Each probe's ring buffer, in pages: a power of two (Settings.ringbuf_pages). */
#ifndef RINGBUF_PAGES
#error "RINGBUF_PAGES must be defined by the loader"
#endif
/* 1: every thread on the machine is traced (node-wide health check), except the
 * recorder's own process SELF_TGID. */
#ifndef TRACE_ALL
#error "TRACE_ALL must be defined by the loader"
#endif
#ifndef SELF_TGID
#error "SELF_TGID must be defined by the loader"
#endif

/* Index into `lost` of each probe (PROBE_SCHED, ...) and their number: declared once in
 * tracer/collector.py PROBE_IDS, passed by the loader.  Each probe checks its own. */
#ifndef PROBE_COUNT
#error "PROBE_COUNT must be defined by the loader"
#endif

/* tid -> tgid of every traced thread: seeded from /proc at start, extended at fork.
 * Kept in a map because sched_switch's incoming task is not `current`. */
BPF_HASH(traced, u32, u32, MAX_THREADS);

BPF_PERCPU_ARRAY(lost, u64, PROBE_COUNT);
struct stack_frames {
    u64 ip[STACK_FRAMES];
};
BPF_TABLE("stacktrace", int, struct stack_frames, stacks, STACK_ENTRIES);
/* [0] stack walks, [1] of them lost because their bucket held another stack */
BPF_PERCPU_ARRAY(stack_counts, u64, 2);
BPF_PERCPU_ARRAY(unwoken, u32, PROBE_COUNT); /* records since the last forced wake-up */

static __always_inline u32 current_tid(void)
{
    return (u32)bpf_get_current_pid_tgid();
}

static __always_inline u32 current_tgid(void)
{
    return (u32)(bpf_get_current_pid_tgid() >> 32);
}

/* True when `tid` belongs to the traced tree.  Node-wide, every task but the idle task
 * and the recorder is traced; every caller there runs in a context whose `current` is
 * the task in question or the one acting on it (a waker), so the recorder's own work
 * and its wake-ups stay out. */
static __always_inline int is_traced(u32 tid)
{
    if (TRACE_ALL)
        return tid != 0 && current_tgid() != SELF_TGID;
    return traced.lookup(&tid) != NULL;
}

static __always_inline void count_lost(u32 probe)
{
    u64 *n = lost.lookup(&probe);
    if (n)
        (*n)++;
}

/* The counted maps (per bucket and task, drained whole at every flush) get their entries
 * in one call at each probe, NULL when the map is full (the caller counts it lost):
 *
 *     struct x_count fresh = {};
 *     struct x_count *c = x_counts.lookup_or_try_init(&k, owned_entry(&fresh, &fresh.pid, fresh.comm));
 *
 * bcc writes lookup_or_try_init out as lookup, insert, lookup again, with the second
 * argument inside the insert's branch, so the task is named once per key, not per
 * event.  The call itself stays at each probe: bcc rewrites map calls neither inside a
 * macro nor through a pointer to the map. */
static __always_inline void *owned_entry(void *fresh, u32 *pid, char *comm)
{
    *pid = current_tgid();
    if (comm) /* char[16] in every entry that keeps a name; NULL: none kept */
        bpf_get_current_comm(comm, 16);
    return fresh;
}

/* Argument n (from 1; 0: none, read as 0) of the function a uprobe sits at the start of,
 * by the x86-64 calling convention: six in registers, the 7th on the stack just above
 * the return address, which the stack pointer points at on the first instruction. */
static __always_inline u64 uprobe_arg(struct pt_regs *ctx, int n)
{
    u64 value = 0;
    switch (n) {
    case 1: return PT_REGS_PARM1(ctx);
    case 2: return PT_REGS_PARM2(ctx);
    case 3: return PT_REGS_PARM3(ctx);
    case 4: return PT_REGS_PARM4(ctx);
    case 5: return PT_REGS_PARM5(ctx);
    case 6: return PT_REGS_PARM6(ctx);
    case 7:
        bpf_probe_read_user(&value, sizeof(value), (void *)(PT_REGS_SP(ctx) + 8));
        return value;
    }
    return 0;
}

#define STACK_EEXIST 17 /* bpf_get_stackid: the bucket holds another stack */

/* A stack's id, or a negative errno; collisions are counted, not silently lost. */
static __always_inline int stack_id(void *ctx, u64 flags)
{
    int id = stacks.get_stackid(ctx, flags);
    u32 slot = 0;
    u64 *n = stack_counts.lookup(&slot);
    if (n)
        (*n)++;
    if (id == -STACK_EEXIST) {
        slot = 1;
        n = stack_counts.lookup(&slot);
        if (n)
            (*n)++;
    }
    return id;
}

/* Flags for ringbuf_submit.  User space drains the ring buffers when it wakes for its own
 * reasons (a flush every second, a collector's sample), so a record normally wakes
 * nobody: the default wake-up per record (whenever the reader has caught up) costs an
 * interrupt and a context switch of the recorder per event of a slow stream.  Every WAKEUP_EVERY records per CPU one forces a wake-up, so a burst is drained
 * long before the ring fills (the loader sizes WAKEUP_EVERY to a quarter of it). */
static __always_inline u64 submit_flags(u32 probe)
{
    u32 *n = unwoken.lookup(&probe);
    if (!n)
        return 0;
    if (++*n < WAKEUP_EVERY)
        return BPF_RB_NO_WAKEUP;
    *n = 0;
    return BPF_RB_FORCE_WAKEUP;
}

#endif
