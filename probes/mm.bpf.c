/* Memory-management waits and churn of traced threads:
 *   mmap_lock waits (start_locking -> acquire_returned) >= MIN_LOCK_NS,
 *   direct and memcg reclaim, compaction, NUMA task moves and page migrations,
 *   mmap/munmap/brk/madvise/mremap calls with sizes and durations. */
#ifndef MIN_LOCK_NS
#error "MIN_LOCK_NS must be defined by the loader"
#endif

/* The MM_* codes of mm_event.what, from tracer/collectors/mm.py WHAT. */
#ifndef PROBE_MM
#error "PROBE_MM must be defined by the loader"
#endif
#ifndef MM_LOCK_READ
#error "MM_LOCK_READ must be defined by the loader"
#endif
#ifndef MM_LOCK_WRITE
#error "MM_LOCK_WRITE must be defined by the loader"
#endif
#ifndef MM_RECLAIM_DIRECT
#error "MM_RECLAIM_DIRECT must be defined by the loader"
#endif
#ifndef MM_RECLAIM_MEMCG
#error "MM_RECLAIM_MEMCG must be defined by the loader"
#endif
#ifndef MM_COMPACTION
#error "MM_COMPACTION must be defined by the loader"
#endif
#ifndef MM_NUMA_MOVE
#error "MM_NUMA_MOVE must be defined by the loader"
#endif
#ifndef MM_NUMA_SWAP
#error "MM_NUMA_SWAP must be defined by the loader"
#endif
#ifndef MM_MIGRATE
#error "MM_MIGRATE must be defined by the loader"
#endif
#ifndef MM_SYS_MMAP
#error "MM_SYS_MMAP must be defined by the loader"
#endif
#ifndef MM_SYS_MUNMAP
#error "MM_SYS_MUNMAP must be defined by the loader"
#endif
#ifndef MM_SYS_BRK
#error "MM_SYS_BRK must be defined by the loader"
#endif
#ifndef MM_SYS_MADVISE
#error "MM_SYS_MADVISE must be defined by the loader"
#endif
#ifndef MM_SYS_MREMAP
#error "MM_SYS_MREMAP must be defined by the loader"
#endif

struct mm_event {
    u64 ts_ns;
    u64 dur_ns;
    u64 addr;
    u64 size;
    s64 ret;  /* syscall return, pages reclaimed/migrated, compaction status */
    u32 tid;
    u32 pid;
    u32 what; /* MM_* */
    s32 arg;  /* flags/advice, NUMA source node, migrate reason */
    s32 arg2; /* NUMA destination node */
    s32 cpu;
};

struct mm_start {
    u64 ts_ns;
    u64 addr;
    u64 size;
    u32 what;
    s32 arg;
};

BPF_RINGBUF_OUTPUT(mm_events, RINGBUF_PAGES);
/* One in-flight entry per thread and concern: they nest (a syscall takes mmap_lock,
 * an allocation inside it reclaims). */
#define MM_INFLIGHT_LOCK 0
#define MM_INFLIGHT_RECLAIM 1
#define MM_INFLIGHT_COMPACTION 2
#define MM_INFLIGHT_SYSCALL 3

struct mm_key {
    u32 tid;
    u32 concern; /* MM_INFLIGHT_* */
};

BPF_HASH(mm_inflight, struct mm_key, struct mm_start, MAX_THREADS);

static __always_inline void mm_emit(u32 what, u64 ts, u64 dur, u64 addr, u64 size, s64 ret,
                                    s32 arg, s32 arg2)
{
    struct mm_event *e = mm_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_MM);
        return;
    }
    e->ts_ns = ts;
    e->dur_ns = dur;
    e->addr = addr;
    e->size = size;
    e->ret = ret;
    e->tid = current_tid();
    e->pid = current_tgid();
    e->what = what;
    e->arg = arg;
    e->arg2 = arg2;
    e->cpu = bpf_get_smp_processor_id();
    mm_events.ringbuf_submit(e, submit_flags(PROBE_MM));
}

/* Begins an interval of a traced thread for `concern`. */
static __always_inline int mm_begin(u32 concern, u32 what, u64 addr, u64 size, s32 arg)
{
    struct mm_key key = {.tid = current_tid(), .concern = concern};
    if (!is_traced(key.tid))
        return 0;
    struct mm_start s = {.ts_ns = bpf_ktime_get_ns(), .addr = addr, .size = size,
                         .what = what, .arg = arg};
    mm_inflight.update(&key, &s);
    return 0;
}

/* Ends the interval begun for `concern`; emits it when it lasted >= min_ns. */
static __always_inline int mm_end(u32 concern, s64 ret, u64 min_ns)
{
    struct mm_key key = {.tid = current_tid(), .concern = concern};
    struct mm_start *s = mm_inflight.lookup(&key);
    if (!s)
        return 0;
    struct mm_start start = *s;
    mm_inflight.delete(&key);
    u64 dur = bpf_ktime_get_ns() - start.ts_ns;
    if (dur >= min_ns)
        mm_emit(start.what, start.ts_ns, dur, start.addr, start.size, ret, start.arg, 0);
    return 0;
}

TRACEPOINT_PROBE(mmap_lock, mmap_lock_start_locking)
{
    return mm_begin(MM_INFLIGHT_LOCK, args->write ? MM_LOCK_WRITE : MM_LOCK_READ, 0, 0, 0);
}

TRACEPOINT_PROBE(mmap_lock, mmap_lock_acquire_returned)
{
    return mm_end(MM_INFLIGHT_LOCK, args->success, MIN_LOCK_NS);
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin)
{
    return mm_begin(MM_INFLIGHT_RECLAIM, MM_RECLAIM_DIRECT, 0, 0, args->order);
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end)
{
    return mm_end(MM_INFLIGHT_RECLAIM, args->nr_reclaimed, 0);
}

#ifdef HAVE_TP_VMSCAN_MM_VMSCAN_MEMCG_RECLAIM_BEGIN
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_begin)
{
    return mm_begin(MM_INFLIGHT_RECLAIM, MM_RECLAIM_MEMCG, 0, 0, args->order);
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_end)
{
    return mm_end(MM_INFLIGHT_RECLAIM, args->nr_reclaimed, 0);
}
#endif

TRACEPOINT_PROBE(compaction, mm_compaction_begin)
{
    return mm_begin(MM_INFLIGHT_COMPACTION, MM_COMPACTION, 0, 0, 0);
}

TRACEPOINT_PROBE(compaction, mm_compaction_end)
{
    return mm_end(MM_INFLIGHT_COMPACTION, args->status, 0);
}

TRACEPOINT_PROBE(sched, sched_move_numa)
{
    if (!is_traced(args->pid))
        return 0;
    mm_emit(MM_NUMA_MOVE, bpf_ktime_get_ns(), 0, 0, 0, args->dst_cpu, args->src_nid, args->dst_nid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_swap_numa)
{
    if (!is_traced(args->src_pid))
        return 0;
    mm_emit(MM_NUMA_SWAP, bpf_ktime_get_ns(), 0, 0, 0, args->dst_cpu, args->src_nid, args->dst_nid);
    return 0;
}

TRACEPOINT_PROBE(migrate, mm_migrate_pages)
{
    if (!is_traced(current_tid()))
        return 0;
    mm_emit(MM_MIGRATE, bpf_ktime_get_ns(), 0, 0, args->failed, args->succeeded, args->reason, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    return mm_begin(MM_INFLIGHT_SYSCALL, MM_SYS_MMAP, args->addr, args->len, (s32)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_enter_munmap)
{
    return mm_begin(MM_INFLIGHT_SYSCALL, MM_SYS_MUNMAP, args->addr, args->len, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_brk)
{
    return mm_begin(MM_INFLIGHT_SYSCALL, MM_SYS_BRK, args->brk, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_madvise)
{
    return mm_begin(MM_INFLIGHT_SYSCALL, MM_SYS_MADVISE, args->start, args->len_in, args->behavior);
}

TRACEPOINT_PROBE(syscalls, sys_enter_mremap)
{
    return mm_begin(MM_INFLIGHT_SYSCALL, MM_SYS_MREMAP, args->addr, args->new_len, (s32)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { return mm_end(MM_INFLIGHT_SYSCALL, args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_munmap) { return mm_end(MM_INFLIGHT_SYSCALL, args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_brk) { return mm_end(MM_INFLIGHT_SYSCALL, args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_madvise) { return mm_end(MM_INFLIGHT_SYSCALL, args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_mremap) { return mm_end(MM_INFLIGHT_SYSCALL, args->ret, 0); }
