/* CUDA runtime and driver calls of traced threads, from uprobes on libcudart/libcuda
 * (attached by tracer/collectors/cuda.py to whichever of these symbols, and their _v2/_ptsz/_ptds
 * aliases, a library exports).
 *
 * Launches are counted per (thread, CUDA_BUCKET_NS bucket, layer, nesting), none is
 * streamed: training issues tens of thousands a second.  Each thread counts its current
 * bucket in its own record (cuda_threads, one array lookup per launch) and moves it into
 * the hash the collector drains (cuda_launches) when a launch falls in a later bucket;
 * the collector takes the records' last buckets at the stop.
 * Waits, copies, allocations and frees lasting at least MIN_CUDA_NS are streamed with
 * their start, duration, stream (or pointer) argument, bytes, return value, source pointer
 * (copies) and the user stack at the call; event records, queries and stream waits on
 * events every one (a not-ready query returns at once, and it is what holds a free
 * back).  The runtime calls the driver inside its own calls, so entries are
 * kept per (tid, layer) and a driver call made inside a runtime call is marked nested.
 * Launches have no return probe (a uretprobe costs several times the uprobe): a runtime
 * launch leaves a mark that the driver launch it makes within CUDA_NEST_JIFFIES consumes. */
#ifndef MIN_CUDA_NS
#error "MIN_CUDA_NS must be defined by the loader"
#endif
#ifndef CUDA_BUCKET_NS
#error "CUDA_BUCKET_NS must be defined by the loader"
#endif
#ifndef CUDA_NEST_JIFFIES
#error "CUDA_NEST_JIFFIES must be defined by the loader"
#endif
#ifndef CUDA_LAUNCH_ENTRIES
#error "CUDA_LAUNCH_ENTRIES must be defined by the loader"
#endif

/* Layers (LAYER_RUNTIME, LAYER_DRIVER), call kinds (CUDA_LAUNCH, ...) and the calls
 * (CUDA_CALLS, with where each one's arguments are) come from tracer/collectors/cuda.py LAYERS,
 * KINDS and CALLS; the sizes and thresholds above from Settings and tracer/collectors/cuda.py. */
#ifndef PROBE_CUDA
#error "PROBE_CUDA must be defined by the loader"
#endif
#ifndef LAYER_RUNTIME
#error "LAYER_RUNTIME must be defined by the loader"
#endif
#ifndef LAYER_DRIVER
#error "LAYER_DRIVER must be defined by the loader"
#endif
#ifndef CUDA_LAUNCH
#error "CUDA_LAUNCH must be defined by the loader"
#endif
#ifndef CUDA_ALLOC
#error "CUDA_ALLOC must be defined by the loader"
#endif
#ifndef CUDA_EVENT
#error "CUDA_EVENT must be defined by the loader"
#endif
#ifndef CUDA_CALLS
#error "CUDA_CALLS must be defined by the loader"
#endif
/* The slots of a thread's record (tracer/collectors/cuda.py LAUNCH_SLOTS): runtime launches, driver
 * launches made directly, driver launches made inside a runtime launch. */
#ifndef CUDA_SLOTS
#error "CUDA_SLOTS must be defined by the loader"
#endif
#ifndef CUDA_SLOT_RUNTIME
#error "CUDA_SLOT_RUNTIME must be defined by the loader"
#endif
#ifndef CUDA_SLOT_DRIVER
#error "CUDA_SLOT_DRIVER must be defined by the loader"
#endif
#ifndef CUDA_SLOT_NESTED
#error "CUDA_SLOT_NESTED must be defined by the loader"
#endif

struct cuda_event {
    u64 ts_ns;
    u64 dur_ns;
    u64 addr; /* the stream (event for event waits, pointer for frees and allocations), 0 when none */
    u64 bytes;
    s64 ret;
    u32 tid;
    u32 pid;
    u32 name; /* the call: its index in tracer/collectors/cuda.py CALLS */
    u32 nested; /* a driver call made inside a runtime call */
    s32 ustack_id;
    u32 layer;
    u64 stream; /* the stream an event is recorded on or made to wait, 0 for other calls */
    u64 src; /* a copy's source pointer, 0 for other calls */
};

struct cuda_key {
    u32 tid;
    u32 layer;
};

struct cuda_call {
    u64 ts_ns;
    u64 arg;
    u64 bytes;
    u64 stream;
    u64 src;
    u32 call;
    u32 nested;
};

struct cuda_launch_key {
    u64 bucket;
    u32 tid;
    u32 pid;
    u32 layer;
    u32 nested;
};

BPF_RINGBUF_OUTPUT(cuda_events, RINGBUF_PAGES);
BPF_HASH(cuda_calls, struct cuda_key, struct cuda_call, MAX_THREADS);
/* Launches in a finished bucket, and the first one's time, which makes a launch gap
 * after a wait exact. */
struct cuda_launch_count {
    u64 launches;
    u64 first_ns;
};

BPF_HASH(cuda_launches, struct cuda_launch_key, struct cuda_launch_count, CUDA_LAUNCH_ENTRIES);

/* A thread's current bucket: launches and first launch time per slot, and whether its
 * last runtime launch is still waiting for the driver launch it makes.  Written only by
 * the thread that owns the record. */
struct cuda_thread {
    u64 end_ns; /* the bucket's end */
    u64 checked_jiffies; /* the tick in which the clock last said the bucket was current */
    u64 marked; /* a runtime launch is waiting for its driver launch */
    u64 mark_jiffies;
    u64 launches[CUDA_SLOTS];
    u64 first_ns[CUDA_SLOTS];
    u32 tid; /* the owner (0: none yet) */
    u32 pid;
};

/* Records in an array at tid % CUDA_THREAD_RECORDS: an array lookup is inlined by the
 * verifier, a hash lookup hashes and walks a bucket, and this is paid twice per runtime
 * launch.  A traced thread whose slot another thread owns takes it over after moving the
 * owner's bucket out (counts stay exact; two such threads launching on two CPUs at the
 * same moment could lose a count to the race). */
#ifndef CUDA_THREAD_RECORDS
#error "CUDA_THREAD_RECORDS must be defined by the loader"
#endif
BPF_ARRAY(cuda_threads, struct cuda_thread, CUDA_THREAD_RECORDS);

/* Move a thread's finished bucket into cuda_launches: once per bucket, not per launch. */
static __always_inline void cuda_flush(struct cuda_thread *t)
{
    for (int slot = 0; slot < CUDA_SLOTS; slot++) {
        if (!t->launches[slot])
            continue;
        struct cuda_launch_key key = {.bucket = t->end_ns / CUDA_BUCKET_NS - 1, .tid = t->tid, .pid = t->pid,
                                      .layer = slot == CUDA_SLOT_RUNTIME ? LAYER_RUNTIME : LAYER_DRIVER,
                                      .nested = slot == CUDA_SLOT_NESTED};
        struct cuda_launch_count first = {.first_ns = t->first_ns[slot]};
        struct cuda_launch_count *n = cuda_launches.lookup_or_try_init(&key, &first);
        if (n)
            __sync_fetch_and_add(&n->launches, t->launches[slot]);
        else
            count_lost(PROBE_CUDA);
    }
}

/* Count a launch: one lookup, of the thread's record.  A record is made only for a
 * traced thread, and threads leave the traced set only when they exit, so a record of
 * the same thread and process stands for the traced check; anything else is checked.
 * The clock (~80 ns in a VM) is read only when jiffies (~5 ns) moved since it last said
 * the bucket was current, and for a slot's first launch in a bucket: a launch less than
 * a tick after a bucket's end may count in it.  A driver launch
 * consuming a runtime launch's mark is counted in the runtime launch's bucket, first at
 * that bucket's first runtime launch. */
static __always_inline int cuda_launch(u32 layer)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, pid = id >> 32;
    u32 index = tid & (CUDA_THREAD_RECORDS - 1);
    struct cuda_thread *t = cuda_threads.lookup(&index);
    if (!t)
        return 0;
    u64 jiffies = bpf_jiffies64();
    int owner = t->tid == tid && t->pid == pid;
    if (owner && layer == LAYER_DRIVER && t->marked) {
        t->marked = 0;
        if (jiffies - t->mark_jiffies <= CUDA_NEST_JIFFIES) {
            t->launches[CUDA_SLOT_NESTED]++;
            if (!t->first_ns[CUDA_SLOT_NESTED])
                t->first_ns[CUDA_SLOT_NESTED] = t->first_ns[CUDA_SLOT_RUNTIME];
            return 0;
        }
    }
    u64 now = 0;
    if (!owner || t->checked_jiffies != jiffies) {
        if (!owner && !is_traced(tid))
            return 0;
        now = bpf_ktime_get_ns();
        if (!owner || now >= t->end_ns) {
            if (t->tid)
                cuda_flush(t);
            struct cuda_thread fresh = {.end_ns = (now / CUDA_BUCKET_NS + 1) * CUDA_BUCKET_NS, .tid = tid, .pid = pid};
            *t = fresh;
        }
        t->checked_jiffies = jiffies;
    }
    int slot = layer == LAYER_RUNTIME ? CUDA_SLOT_RUNTIME : CUDA_SLOT_DRIVER;
    t->launches[slot]++;
    if (!t->first_ns[slot])
        t->first_ns[slot] = now ? now : bpf_ktime_get_ns();
    if (layer == LAYER_RUNTIME) {
        t->marked = 1;
        t->mark_jiffies = jiffies;
    }
    return 0;
}

/* Arguments are read with common.h uprobe_arg; none of the calls read here has what we
 * need beyond the sixth (cuLaunchKernel's stream, the 9th, is on the stack, but launches
 * are only counted). */
static __always_inline int cuda_enter(struct pt_regs *ctx, u32 call, u32 layer, u32 kind, u64 arg, u64 bytes,
                                      u64 stream, u64 src)
{
    if (kind == CUDA_LAUNCH)
        return cuda_launch(layer);
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    u32 nested = 0;
    if (layer == LAYER_DRIVER) {
        struct cuda_key outer = {.tid = tid, .layer = LAYER_RUNTIME};
        nested = cuda_calls.lookup(&outer) != NULL;
    }
    struct cuda_key key = {.tid = tid, .layer = layer};
    struct cuda_call c = {.ts_ns = bpf_ktime_get_ns(), .arg = arg, .bytes = bytes, .stream = stream,
                         .src = src, .call = call, .nested = nested};
    cuda_calls.update(&key, &c);
    return 0;
}

static __always_inline int cuda_return(struct pt_regs *ctx, u32 layer, u32 kind)
{
    struct cuda_key key = {.tid = current_tid(), .layer = layer};
    struct cuda_call *found = cuda_calls.lookup(&key);
    if (!found)
        return 0;
    struct cuda_call c = *found;
    cuda_calls.delete(&key);
    u64 dur = bpf_ktime_get_ns() - c.ts_ns;
    if (dur < MIN_CUDA_NS && kind != CUDA_EVENT)
        return 0;
    struct cuda_event *e = cuda_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_CUDA);
        return 0;
    }
    e->ts_ns = c.ts_ns;
    e->dur_ns = dur;
    e->addr = c.arg;
    if (kind == CUDA_ALLOC) { /* the new pointer, written where the first argument points */
        e->addr = 0;
        if (c.arg)
            bpf_probe_read_user(&e->addr, sizeof(e->addr), (void *)c.arg);
    }
    e->bytes = c.bytes;
    e->stream = c.stream;
    e->src = c.src;
    e->ret = (s32)PT_REGS_RC(ctx); /* cudaError_t / CUresult: a C enum */
    e->tid = key.tid;
    e->pid = current_tgid();
    e->name = c.call;
    e->nested = c.nested;
    e->layer = layer;
    e->ustack_id = stack_id(ctx, BPF_F_USER_STACK); /* at the return: the caller's stack */
    cuda_events.ringbuf_submit(e, submit_flags(PROBE_CUDA));
    return 0;
}

/* One entry/return pair per call: CUDA_CALLS is CALL(symbol, call code, layer, kind,
 * stream argument, bytes argument, event call's stream argument, copy's source argument)
 * for each, from tracer/collectors/cuda.py CALLS (the call code being its position there;
 * an argument number 0 reads nothing). */
#define CALL(sym, call, layer, kind, arg_n, bytes_n, stream_n, src_n)                        \
    int enter_##sym(struct pt_regs *ctx)                                                       \
    {                                                                                          \
        return cuda_enter(ctx, call, layer, kind, uprobe_arg(ctx, arg_n), uprobe_arg(ctx, bytes_n), \
                          uprobe_arg(ctx, stream_n), uprobe_arg(ctx, src_n));                  \
    }                                                                                          \
    int return_##sym(struct pt_regs *ctx) { return cuda_return(ctx, layer, kind); }

CUDA_CALLS
