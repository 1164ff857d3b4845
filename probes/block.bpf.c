/* Block requests submitted by traced threads: insert/issue (whichever comes first, in
 * the submitter's context) to completion.  Requests submitted by kernel flusher threads
 * are not the trainer's and are left out; their effect shows as dirty throttling. */
#ifndef PROBE_BLOCK
#error "PROBE_BLOCK must be defined by the loader"
#endif
struct block_event {
    u64 ts_ns;
    u64 dur_ns;
    u64 sector;
    u32 bytes;
    u32 dev;
    u32 tid;
    u32 pid;
    char rwbs[8];
};

struct block_key {
    u64 sector;
    u32 dev;
    u32 pad;
};

struct block_start {
    u64 ts_ns;
    u32 bytes;
    u32 tid;
    u32 pid;
    u32 pad;
};

BPF_RINGBUF_OUTPUT(block_events, RINGBUF_PAGES);
BPF_HASH(block_inflight, struct block_key, struct block_start, MAX_THREADS);

static __always_inline int block_start(u64 sector, u32 dev, u32 bytes)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct block_key k = {.sector = sector, .dev = dev};
    struct block_start s = {.ts_ns = bpf_ktime_get_ns(), .bytes = bytes, .tid = tid,
                            .pid = current_tgid()};
    block_inflight.insert(&k, &s); /* keeps the earlier of insert and issue */
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_insert) { return block_start(args->sector, args->dev, args->bytes); }
TRACEPOINT_PROBE(block, block_rq_issue) { return block_start(args->sector, args->dev, args->bytes); }

TRACEPOINT_PROBE(block, block_rq_complete)
{
    struct block_key k = {.sector = args->sector, .dev = args->dev};
    struct block_start *s = block_inflight.lookup(&k);
    if (!s)
        return 0;
    struct block_start st = *s;
    block_inflight.delete(&k);
    struct block_event *e = block_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_BLOCK);
        return 0;
    }
    e->ts_ns = st.ts_ns;
    e->dur_ns = bpf_ktime_get_ns() - st.ts_ns;
    e->sector = k.sector;
    e->bytes = st.bytes;
    e->dev = k.dev;
    e->tid = st.tid;
    e->pid = st.pid;
    __builtin_memcpy(e->rwbs, args->rwbs, sizeof(e->rwbs));
    block_events.ringbuf_submit(e, submit_flags(PROBE_BLOCK));
    return 0;
}
