/* CPU-clock samples of traced threads with kernel and user stacks.  Without kprobes this
 * is how running time splits into user work and kernel work (fault handling, page
 * zeroing, reclaim, syscalls).  Attached as a perf event at ONCPU_HZ by the collector. */
#ifndef PROBE_ONCPU
#error "PROBE_ONCPU must be defined by the loader"
#endif
#include <uapi/linux/bpf_perf_event.h>

struct oncpu_event {
    u64 ts_ns;
    u32 tid;
    u32 pid;
    s32 cpu;
    s32 kstack_id;
    s32 ustack_id;
    s32 pystack_id; /* probes/pyframes.h */
};

BPF_RINGBUF_OUTPUT(oncpu_events, RINGBUF_PAGES);

int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct oncpu_event *e = oncpu_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_ONCPU);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->tid = tid;
    e->pid = current_tgid();
    e->cpu = bpf_get_smp_processor_id();
    e->kstack_id = stack_id(ctx, 0);
    e->ustack_id = stack_id(ctx, BPF_F_USER_STACK);
    e->pystack_id = py_stack();
    oncpu_events.ringbuf_submit(e, submit_flags(PROBE_ONCPU));
    return 0;
}
