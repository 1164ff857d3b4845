/* User page faults per traced thread, counted in the kernel per FAULT_BUCKET_NS time
 * bucket: faults come in the hundreds of thousands per second, their count is what
 * matters.  Time spent inside faults shows up in on-CPU samples and off-CPU stacks. */
#ifndef FAULT_BUCKET_NS
#define FAULT_BUCKET_NS 100000000ULL
#endif

struct fault_key {
    u64 bucket;
    u32 tid;
    u32 pid;
};

BPF_HASH(fault_counts, struct fault_key, u64, MAX_THREADS);

TRACEPOINT_PROBE(exceptions, page_fault_user)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct fault_key key = {};
    key.bucket = bpf_ktime_get_ns() / FAULT_BUCKET_NS;
    key.tid = tid;
    key.pid = current_tgid();
    u64 zero = 0;
    u64 *n = fault_counts.lookup_or_try_init(&key, &zero);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        count_lost(PROBE_FAULTS);
    return 0;
}
