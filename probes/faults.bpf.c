/* User page faults per traced thread, counted in the kernel per FAULT_BUCKET_NS time
 * bucket: faults come in the hundreds of thousands per second, their count is what
 * matters.  Time spent inside faults shows up in on-CPU samples and off-CPU stacks.
 *
 * Faults come in runs (a thread touching a fresh buffer faults on page after page), so
 * each CPU counts its current run of one thread in one bucket in a per-CPU slot and adds
 * it to fault_counts only when the run ends: a fault costs no hash lookup unless it
 * starts a run.  User space reads the slots once more at the end (after detaching).
 * Reading the clock costs more than the rest (docs/performance.md), so a run re-reads it
 * only when jiffies move: a fault less than one tick after a bucket boundary may count
 * in the bucket before. */
#ifndef PROBE_FAULTS
#error "PROBE_FAULTS must be defined by the loader"
#endif
#ifndef FAULT_BUCKET_NS
#define FAULT_BUCKET_NS 100000000ULL
#endif

struct fault_key {
    u64 bucket;
    u32 tid;
    u32 pid;
};

struct fault_run {
    u64 bucket;
    u64 jiffies; /* when the bucket was last checked */
    u32 tid;
    u32 pid;
    u64 count;
    u64 traced; /* 0: the thread is not traced, its faults are not counted */
};

BPF_HASH(fault_counts, struct fault_key, u64, MAX_THREADS);
BPF_PERCPU_ARRAY(fault_runs, struct fault_run, 1);

static __always_inline void end_run(struct fault_run *run)
{
    if (!run->count)
        return;
    struct fault_key key = {.bucket = run->bucket, .tid = run->tid, .pid = run->pid};
    u64 zero = 0;
    u64 *n = fault_counts.lookup_or_try_init(&key, &zero);
    if (n) {
        __sync_fetch_and_add(n, run->count);
    } else {
        u32 probe = PROBE_FAULTS;
        u64 *lost_n = lost.lookup(&probe);
        if (lost_n)
            *lost_n += run->count;
    }
    run->count = 0;
}

/* The raw tracepoint: it reads nothing from the arguments, and skips building the
 * trace record the classic one fills first (docs/performance.md). */
RAW_TRACEPOINT_PROBE(page_fault_user)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u64 jiffies = bpf_jiffies64();
    u32 zero = 0;
    struct fault_run *run = fault_runs.lookup(&zero);
    if (!run)
        return 0;
    if (run->tid != tid || run->jiffies != jiffies) {
        u64 bucket = bpf_ktime_get_ns() / FAULT_BUCKET_NS;
        if (run->tid != tid || run->bucket != bucket) {
            end_run(run);
            run->bucket = bucket;
            run->tid = tid;
            run->pid = id >> 32;
            run->traced = is_traced(tid);
        }
        run->jiffies = jiffies;
    }
    if (run->traced)
        run->count++;
    return 0;
}
