/* Dirty-page throttling of traced writers, and (below) writeback and dirtying per inode
 * of every task.
 *
 * Throttling: writeback:balance_dirty_pages fires in the writer's context
 * just before it sleeps.  The event's `pause` field is already in milliseconds (the
 * tracepoint stores pause * 1000 / HZ), so a pause is a whole number of ticks rounded
 * down to the millisecond; the event carries it in nanoseconds. */
#ifndef PROBE_WRITEBACK
#error "PROBE_WRITEBACK must be defined by the loader"
#endif
struct dirty_event {
    u64 ts_ns;
    s64 dur_ns; /* the pause */
    u64 dirty_pages;
    u64 limit_pages;
    u32 tid;
    u32 pid;
    char device[32]; /* the backing device (the tracepoint's bdi) */
};

BPF_RINGBUF_OUTPUT(writeback_events, RINGBUF_PAGES);

TRACEPOINT_PROBE(writeback, balance_dirty_pages)
{
    u32 tid = current_tid();
    if (!is_traced(tid) || args->pause <= 0)
        return 0;
    struct dirty_event *e = writeback_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_WRITEBACK);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->dur_ns = args->pause * 1000000LL;
    e->dirty_pages = args->dirty;
    e->limit_pages = args->limit;
    e->tid = tid;
    e->pid = current_tgid();
    __builtin_memcpy(e->device, args->bdi, sizeof(e->device));
    writeback_events.ringbuf_submit(e, submit_flags(PROBE_WRITEBACK));
    return 0;
}

/* Writeback and dirtying per inode, of every task on the machine, counted in the kernel
 * per (bucket, device, inode, task): pages written back by writeback_single_inode (a
 * flusher's pass over an inode, or sync's; fsync writes its range without it) and folios
 * dirtied, in the dirtier's context (writeback_dirty_folio; a folio may be larger than a
 * page, and the tracepoint does not say how large).  The device is the backing device's
 * name, "MAJ:MIN" for a block device's filesystem: its first 16 bytes key the count
 * (the tracepoint pads the name with NULs). */
#ifndef DISK_BUCKET_NS
#error "DISK_BUCKET_NS must be defined by the loader"
#endif
#ifndef WRITTEN_ENTRIES
#error "WRITTEN_ENTRIES must be defined by the loader"
#endif
#ifndef DIRTIED_ENTRIES
#error "DIRTIED_ENTRIES must be defined by the loader"
#endif
#ifndef INODE_WRITTEN
#error "INODE_WRITTEN must be defined by the loader"
#endif
#ifndef INODE_DIRTIED
#error "INODE_DIRTIED must be defined by the loader"
#endif

struct inode_key {
    u64 bucket; /* bpf_ktime_get_ns() / DISK_BUCKET_NS */
    u64 ino;
    char bdi[16];
    u32 tid;
    u32 pad;
};

struct inode_count {
    u64 count;
    u32 pid;
    u32 pad;
    char comm[16];
};

/* Drained whole at every flush (tracer/collectors/writeback.py); past it, counted as lost.
 * Apart, so that a flood of files dirtied leaves room for the counts of writeback. */
BPF_HASH(written_inodes, struct inode_key, struct inode_count, WRITTEN_ENTRIES);
BPF_HASH(dirtied_inodes, struct inode_key, struct inode_count, DIRTIED_ENTRIES);

/* Add n to the current task's count for a bdi name and inode in the map of `what`
 * (INODE_WRITTEN: pages written back, INODE_DIRTIED: folios dirtied); the task's name is
 * read once per key, not per event. */
static __always_inline int count_inode(u32 what, const char *bdi, u64 ino, u64 n)
{
    u64 id = bpf_get_current_pid_tgid();
    if (id >> 32 == SELF_TGID) /* the recorder never counts itself */
        return 0;
    struct inode_key k = {.bucket = bpf_ktime_get_ns() / DISK_BUCKET_NS, .ino = ino, .tid = (u32)id};
    __builtin_memcpy(k.bdi, bdi, sizeof(k.bdi));
    struct inode_count fresh = {};
    struct inode_count *c;
    if (what == INODE_WRITTEN)
        c = written_inodes.lookup_or_try_init(&k, owned_entry(&fresh, &fresh.pid, fresh.comm));
    else
        c = dirtied_inodes.lookup_or_try_init(&k, owned_entry(&fresh, &fresh.pid, fresh.comm));
    if (!c) {
        count_lost(PROBE_WRITEBACK);
        return 0;
    }
    __sync_fetch_and_add(&c->count, n);
    return 0;
}

TRACEPOINT_PROBE(writeback, writeback_single_inode)
{
    if (!args->wrote) /* the inode's metadata alone */
        return 0;
    return count_inode(INODE_WRITTEN, args->name, args->ino, args->wrote);
}

TRACEPOINT_PROBE(writeback, writeback_dirty_folio)
{
    return count_inode(INODE_DIRTIED, args->name, args->ino, 1);
}
