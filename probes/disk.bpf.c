/* Block requests of every issuer on every device, traced or not (a kernel flusher
 * included), counted in the kernel per (bucket, device, issuing task, direction).
 *
 * block_io_start fires as a request is made from a bio, in the submitter's context: the
 * task that called submit_bio (a flusher kworker for background writeback, the reader for
 * O_DIRECT reads and page-cache misses, the fsync-ing thread for its own range).
 * block_rq_issue runs wherever the hardware queue is run (kblockd), so it cannot name
 * the issuer.  A bio merged into a request already made adds its bytes but no request
 * (block_bio_backmerge/frontmerge, also in the submitter's context).  Kernels before 6.5
 * lack block_io_start: there every bio counts at block_bio_queue, and requests are bios. */
#ifndef PROBE_DISK
#error "PROBE_DISK must be defined by the loader"
#endif
#ifndef DISK_BUCKET_NS
#error "DISK_BUCKET_NS must be defined by the loader"
#endif
#ifndef DISK_ENTRIES
#error "DISK_ENTRIES must be defined by the loader"
#endif
#ifndef DISK_READ
#error "DISK_READ must be defined by the loader"
#endif
#ifndef DISK_WRITE
#error "DISK_WRITE must be defined by the loader"
#endif
#ifndef DISK_OTHER
#error "DISK_OTHER must be defined by the loader"
#endif

struct disk_key {
    u64 bucket; /* bpf_ktime_get_ns() / DISK_BUCKET_NS */
    u32 dev;    /* the whole disk, kernel dev_t (major << 20 | minor) */
    u32 tid;    /* the issuing task */
    u32 direction;
    u32 pad;
};

struct disk_count {
    u64 bytes;
    u64 requests;
    u32 pid;
    u32 pad;
    char comm[16];
};

/* Drained whole at every flush (tracer/collectors/disk.py); past it, counted as lost. */
BPF_HASH(disk_counts, struct disk_key, struct disk_count, DISK_ENTRIES);

/* rwbs: an optional 'F' (preflush), then the operation: R read, W write, D discard,
 * E secure erase, N none.  An empty preflush write is a cache flush: "other". */
static __always_inline u32 disk_direction(const char *rwbs, u64 bytes)
{
    char op = rwbs[0] == 'F' ? rwbs[1] : rwbs[0];
    if (op == 'R')
        return DISK_READ;
    if (op == 'W' && bytes)
        return DISK_WRITE;
    return DISK_OTHER;
}

static __always_inline int disk_count(u32 dev, const char *rwbs, u64 bytes, u64 requests)
{
    u64 id = bpf_get_current_pid_tgid();
    if (id >> 32 == SELF_TGID) /* the recorder never counts itself (its flusher's work counts) */
        return 0;
    struct disk_key k = {.bucket = bpf_ktime_get_ns() / DISK_BUCKET_NS, .dev = dev, .tid = (u32)id,
                         .direction = disk_direction(rwbs, bytes)};
    struct disk_count fresh = {};
    struct disk_count *c = disk_counts.lookup_or_try_init(&k, owned_entry(&fresh, &fresh.pid, fresh.comm));
    if (!c) {
        count_lost(PROBE_DISK);
        return 0;
    }
    __sync_fetch_and_add(&c->bytes, bytes);
    __sync_fetch_and_add(&c->requests, requests);
    return 0;
}

#ifdef HAVE_TP_BLOCK_BLOCK_IO_START
TRACEPOINT_PROBE(block, block_io_start) { return disk_count(args->dev, args->rwbs, args->bytes, 1); }

TRACEPOINT_PROBE(block, block_bio_backmerge)
{
    return disk_count(args->dev, args->rwbs, (u64)args->nr_sector << 9, 0);
}

TRACEPOINT_PROBE(block, block_bio_frontmerge)
{
    return disk_count(args->dev, args->rwbs, (u64)args->nr_sector << 9, 0);
}
#else
TRACEPOINT_PROBE(block, block_bio_queue)
{
    return disk_count(args->dev, args->rwbs, (u64)args->nr_sector << 9, 1);
}
#endif
