/* TLB shootdowns of traced threads, counted in the kernel per (bucket, thread, side).
 *
 * tlb:tlb_flush fires with reason TLB_REMOTE_SEND_IPI in the context of the thread that
 * changed a mapping other CPUs may cache (munmap, madvise(MADV_DONTNEED), mprotect,
 * page migration) just before it sends them the flush IPI: the sender.  On each CPU that
 * takes that IPI it fires again with TLB_REMOTE_SHOOTDOWN, in interrupt context: the
 * current task is the one the IPI interrupted, the receiver.  ipi:ipi_send_cpu/cpumask
 * also see the sender but fire for every cross-CPU call (wake-ups too) with a generic
 * callback, so they cannot tell a shootdown from a wake-up. */
#ifndef PROBE_TLB
#error "PROBE_TLB must be defined by the loader"
#endif
#ifndef DISK_BUCKET_NS
#error "DISK_BUCKET_NS must be defined by the loader"
#endif
#ifndef TLB_ENTRIES
#error "TLB_ENTRIES must be defined by the loader"
#endif
#ifndef TLB_SENT
#error "TLB_SENT must be defined by the loader"
#endif
#ifndef TLB_RECEIVED
#error "TLB_RECEIVED must be defined by the loader"
#endif
/* enum tlb_flush_reason (include/linux/mm_types.h), from the tracepoint's print format. */
#ifndef TLB_REASON_SHOOTDOWN
#error "TLB_REASON_SHOOTDOWN must be defined by the loader"
#endif
#ifndef TLB_REASON_SEND_IPI
#error "TLB_REASON_SEND_IPI must be defined by the loader"
#endif

struct tlb_key {
    u64 bucket; /* bpf_ktime_get_ns() / DISK_BUCKET_NS (the counted probes' one bucket width) */
    u32 tid;
    u32 side;   /* TLB_SENT or TLB_RECEIVED */
};

struct tlb_count {
    u64 flushes;
    u64 pages;  /* pages named (a full flush counts as none) */
    u32 pid;
    u32 cpu;    /* the CPU of the last one (the collector keeps the highest over drains) */
};

/* Drained whole at every flush (tracer/collectors/tlb.py); past it, counted as lost. */
BPF_HASH(tlb_counts, struct tlb_key, struct tlb_count, TLB_ENTRIES);

#ifdef HAVE_TP_TLB_TLB_FLUSH
TRACEPOINT_PROBE(tlb, tlb_flush)
{
    u32 side;
    if (args->reason == TLB_REASON_SEND_IPI)
        side = TLB_SENT;
    else if (args->reason == TLB_REASON_SHOOTDOWN)
        side = TLB_RECEIVED;
    else
        return 0;
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct tlb_key k = {.bucket = bpf_ktime_get_ns() / DISK_BUCKET_NS, .tid = tid, .side = side};
    struct tlb_count fresh = {};
    struct tlb_count *c = tlb_counts.lookup_or_try_init(&k, owned_entry(&fresh, &fresh.pid, NULL));
    if (!c) {
        count_lost(PROBE_TLB);
        return 0;
    }
    __sync_fetch_and_add(&c->flushes, 1);
    /* TLB_FLUSH_ALL is -1 */
    if ((long)args->pages > 0)
        __sync_fetch_and_add(&c->pages, args->pages);
    c->cpu = bpf_get_smp_processor_id();
    return 0;
}
#endif
