/* NCCL collectives of traced threads, from uprobes and uretprobes on libnccl (attached
 * by tracer/collectors/nccl.py to whichever of these symbols a library exports, once per address:
 * NCCL's pnccl* profiling names are aliases of the same functions).
 *
 * Every call that returns is streamed, with no threshold: a job makes at most a few
 * thousand collectives a second, and the analysis matches the k-th call of each rank.
 * So each thread numbers its calls itself (seq), at entry, in one sequence for all the
 * calls probed (ncclGroupEnd included): a lost record leaves a gap in the numbers
 * instead of shifting every later call against the other ranks'. */

/* The calls (NCCL_CALLS) come from tracer/collectors/nccl.py CALLS. */
#ifndef PROBE_NCCL
#error "PROBE_NCCL must be defined by the loader"
#endif
#ifndef NCCL_CALLS
#error "NCCL_CALLS must be defined by the loader"
#endif

struct nccl_event {
    u64 ts_ns;
    u64 dur_ns;
    u64 seq; /* the thread's own count of calls before this one */
    u64 comm; /* the ncclComm_t argument, 0 when none */
    u64 elements; /* the count argument, 0 when none */
    s64 ret;
    u32 tid;
    u32 pid;
    u32 name; /* the call: its index in tracer/collectors/nccl.py CALLS */
    u32 pad;
};

/* A thread's calls so far and the one it is in (active). */
struct nccl_thread {
    u64 next_seq;
    u64 ts_ns;
    u64 seq;
    u64 comm;
    u64 elements;
    u32 call;
    u32 active;
};

BPF_RINGBUF_OUTPUT(nccl_events, RINGBUF_PAGES);
BPF_HASH(nccl_threads, u32, struct nccl_thread, MAX_THREADS);

static __always_inline int nccl_enter(u32 call, u64 comm, u64 elements)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct nccl_thread fresh = {};
    struct nccl_thread *t = nccl_threads.lookup_or_try_init(&tid, &fresh);
    if (!t) {
        count_lost(PROBE_NCCL);
        return 0;
    }
    /* A call whose return never came (the probes attached while it ran) is replaced. */
    t->seq = t->next_seq++;
    t->ts_ns = bpf_ktime_get_ns();
    t->comm = comm;
    t->elements = elements;
    t->call = call;
    t->active = 1;
    return 0;
}

static __always_inline int nccl_return(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct nccl_thread *t = nccl_threads.lookup(&tid);
    if (!t || !t->active)
        return 0;
    t->active = 0;
    struct nccl_event *e = nccl_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_NCCL);
        return 0;
    }
    e->ts_ns = t->ts_ns;
    e->dur_ns = bpf_ktime_get_ns() - t->ts_ns;
    e->seq = t->seq;
    e->comm = t->comm;
    e->elements = t->elements;
    e->ret = (s32)PT_REGS_RC(ctx); /* ncclResult_t: a C enum */
    e->tid = tid;
    e->pid = current_tgid();
    e->name = t->call;
    e->pad = 0;
    nccl_events.ringbuf_submit(e, submit_flags(PROBE_NCCL));
    return 0;
}

/* One entry/return pair per call: NCCL_CALLS is NCCL_CALL(symbol, call code, comm
 * argument, element-count argument) for each, from tracer/collectors/nccl.py CALLS (the call code
 * being its position there; arguments read with common.h uprobe_arg, 0 = none). */
#define NCCL_CALL(sym, call, comm_n, elements_n)                                              \
    int enter_##sym(struct pt_regs *ctx)                                                      \
    {                                                                                         \
        return nccl_enter(call, uprobe_arg(ctx, comm_n), uprobe_arg(ctx, elements_n));        \
    }                                                                                         \
    int return_##sym(struct pt_regs *ctx) { return nccl_return(ctx); }

NCCL_CALLS
