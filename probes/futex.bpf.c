/* Futex waits of traced threads: futex(FUTEX_WAIT*, FUTEX_LOCK_PI*), futex_wait and
 * futex_waitv, with the address waited on and the user stack at entry.  Waits shorter
 * than MIN_FUTEX_NS are dropped in the kernel (sched's short sums still count the time).
 * The user stack is taken at exit, and only for waits that are kept: a syscall returns to
 * where it was called from, so it is the stack at entry. */
#ifndef PROBE_FUTEX
#error "PROBE_FUTEX must be defined by the loader"
#endif
#ifndef MIN_FUTEX_NS
#error "MIN_FUTEX_NS must be defined by the loader"
#endif

#define FUTEX_CMD_MASK 0x7f
#define OP_FUTEX_WAIT_SYSCALL 256
#define OP_FUTEX_WAITV_SYSCALL 257

struct futex_event {
    u64 ts_ns;
    u64 dur_ns;
    u64 addr;
    u32 tid;
    u32 pid;
    s32 futex_op;
    s32 ustack_id;
    s32 pystack_id; /* probes/pyframes.h */
    u32 pad;
};

/* A traced thread's futex wait in progress (ts_ns 0: none).  Kept per thread until it
 * exits (user space removes it), so an entry also says the thread is traced, and
 * rewritten in place: a hash update or delete at every futex call costs an element's
 * allocation and free on top of the lookup, and each lookup here costs ~0.3-0.4 us
 * (docs/performance.md). */
struct futex_wait {
    u64 ts_ns;
    u64 uaddr;
    s32 op;
};

BPF_RINGBUF_OUTPUT(futex_events, RINGBUF_PAGES);
BPF_HASH(futex_waiting, u32, struct futex_wait, MAX_THREADS);

static __always_inline int futex_enter(u64 uaddr, s32 op)
{
    u32 tid = current_tid();
    struct futex_wait *w = futex_waiting.lookup(&tid);
    if (!w) { /* a traced thread's first futex wait, or an untraced thread */
        if (!is_traced(tid))
            return 0;
        struct futex_wait fresh = {};
        fresh.ts_ns = bpf_ktime_get_ns();
        fresh.uaddr = uaddr;
        fresh.op = op;
        if (futex_waiting.update(&tid, &fresh)) /* full: more threads than it holds */
            count_lost(PROBE_FUTEX);
        return 0;
    }
    /* Only this thread writes its entry, and only user space reads it meanwhile. */
    w->uaddr = uaddr;
    w->op = op;
    w->ts_ns = bpf_ktime_get_ns();
    return 0;
}

static __always_inline int futex_exit(void *args)
{
    u32 tid = current_tid();
    struct futex_wait *w = futex_waiting.lookup(&tid);
    if (!w || !w->ts_ns) /* untraced, or a futex call that does not wait */
        return 0;
    u64 dur = bpf_ktime_get_ns() - w->ts_ns;
    struct futex_wait wait = *w;
    w->ts_ns = 0;
    if (dur < MIN_FUTEX_NS)
        return 0;
    struct futex_event *e = futex_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_FUTEX);
        return 0;
    }
    e->ts_ns = wait.ts_ns;
    e->dur_ns = dur;
    e->addr = wait.uaddr;
    e->tid = tid;
    e->pid = current_tgid();
    e->futex_op = wait.op;
    e->ustack_id = stack_id(args, BPF_F_USER_STACK);
    e->pystack_id = py_stack();
    e->pad = 0;
    futex_events.ringbuf_submit(e, submit_flags(PROBE_FUTEX));
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_futex)
{
    s32 cmd = args->op & FUTEX_CMD_MASK;
    /* WAIT, LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2: the calls that block */
    if (cmd != 0 && cmd != 6 && cmd != 9 && cmd != 11 && cmd != 13)
        return 0;
    return futex_enter((u64)args->uaddr, cmd);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex)
{
    return futex_exit(args);
}

#ifdef HAVE_TP_SYSCALLS_SYS_ENTER_FUTEX_WAIT
TRACEPOINT_PROBE(syscalls, sys_enter_futex_wait)
{
    return futex_enter((u64)args->uaddr, OP_FUTEX_WAIT_SYSCALL);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex_wait)
{
    return futex_exit(args);
}
#endif

#ifdef HAVE_TP_SYSCALLS_SYS_ENTER_FUTEX_WAITV
TRACEPOINT_PROBE(syscalls, sys_enter_futex_waitv)
{
    return futex_enter((u64)args->waiters, OP_FUTEX_WAITV_SYSCALL);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex_waitv)
{
    return futex_exit(args);
}
#endif
