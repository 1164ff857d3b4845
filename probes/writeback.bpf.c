/* Dirty-page throttling: writeback:balance_dirty_pages fires in the writer's context
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
