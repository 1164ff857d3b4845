/* Off-CPU intervals of traced threads (sched_switch), the wake-up that ended each
 * (sched_waking runs in the waker's context, unlike sched_wakeup), and the thread table
 * (task_newtask / task_rename / sched_process_exec / sched_process_exit).
 *
 * Intervals >= MIN_BLOCK_NS stream out with stacks; shorter ones are summed in the kernel
 * per (tid, state) so every nanosecond stays accounted for without flooding user space. */
#ifndef MIN_BLOCK_NS
#define MIN_BLOCK_NS 20000
#endif

#ifndef TASK_RINGBUF_PAGES
#define TASK_RINGBUF_PAGES 64
#endif

#define STATE_PREEMPTED 0x100 /* TASK_REPORT_MAX: switched out while runnable */
#define CLONE_THREAD_FLAG 0x00010000

struct offcpu_event {
    u64 ts_ns;   /* switch-out */
    u64 dur_ns;  /* switch-out -> switch-in */
    u64 runq_ns; /* wake-up (or preemption) -> switch-in */
    u32 tid;
    u32 pid;
    u32 waker_tid;
    u32 waker_pid;
    s32 kstack_id;
    s32 ustack_id;
    s32 waker_kstack_id;
    s32 waker_ustack_id;
    s32 cpu;   /* where it ran next */
    s32 state; /* prev_state at switch-out; 0 or STATE_PREEMPTED = preempted */
};

#define TASK_SEED 0
#define TASK_THREAD 1
#define TASK_PROCESS 2
#define TASK_EXEC 3
#define TASK_RENAME 4
#define TASK_EXIT 5

struct task_event {
    u64 ts_ns;
    u32 tid;
    u32 pid;
    u32 parent_tid;
    u32 what; /* TASK_* */
    char comm[16];
};

struct switched_out {
    u64 ts_ns;
    s64 state;
    s32 kstack_id;
    s32 ustack_id;
    u32 tgid; /* read at switch-out, where the task is `current` */
    u32 pad;
};

struct wakeup {
    u64 ts_ns;
    u32 waker_tid;
    u32 waker_pid;
    s32 kstack_id;
    s32 ustack_id;
};

struct short_key {
    u32 tid;
    u32 state;
};

struct short_sum {
    u64 count;
    u64 dur_ns;
    u64 runq_ns;
    u32 pid;
    u32 pad;
};

BPF_RINGBUF_OUTPUT(sched_events, RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(task_events, TASK_RINGBUF_PAGES);
BPF_HASH(switched_out_at, u32, struct switched_out, MAX_THREADS);
BPF_HASH(woken_at, u32, struct wakeup, MAX_THREADS);
BPF_HASH(short_waits, struct short_key, struct short_sum, MAX_THREADS);

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;

    if (prev != 0 && is_traced(prev)) {
        struct switched_out so = {};
        so.ts_ns = now;
        so.tgid = current_tgid();
        so.state = args->prev_state;
        so.kstack_id = stacks.get_stackid(args, 0);
        so.ustack_id = stacks.get_stackid(args, BPF_F_USER_STACK);
        switched_out_at.update(&prev, &so);
    }
    if (next == 0)
        return 0;
    struct switched_out *so = switched_out_at.lookup(&next);
    if (!so)
        return 0;
    u64 dur = now - so->ts_ns;
    s64 state = so->state;
    int preempted = state == 0 || state == STATE_PREEMPTED;
    u64 runq = preempted ? dur : 0;
    struct wakeup *w = woken_at.lookup(&next);
    struct wakeup wake = {};
    if (w && w->ts_ns >= so->ts_ns) {
        wake = *w;
        if (!preempted)
            runq = now - w->ts_ns;
    }
    s32 kstack = so->kstack_id, ustack = so->ustack_id;
    u32 pid = so->tgid;
    switched_out_at.delete(&next);
    woken_at.delete(&next);

    if (dur < MIN_BLOCK_NS) {
        struct short_key key = {.tid = next, .state = preempted ? STATE_PREEMPTED : (u32)(state & 0xff)};
        struct short_sum zero = {};
        struct short_sum *sum = short_waits.lookup_or_try_init(&key, &zero);
        if (sum) {
            sum->count += 1;
            sum->dur_ns += dur;
            sum->runq_ns += runq;
            sum->pid = pid;
        }
        return 0;
    }
    struct offcpu_event *e = sched_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_SCHED);
        return 0;
    }
    e->ts_ns = now - dur;
    e->dur_ns = dur;
    e->runq_ns = runq;
    e->tid = next;
    e->pid = pid;
    e->waker_tid = wake.waker_tid;
    e->waker_pid = wake.waker_pid;
    e->kstack_id = kstack;
    e->ustack_id = ustack;
    e->waker_kstack_id = wake.ts_ns ? wake.kstack_id : -1;
    e->waker_ustack_id = wake.ts_ns ? wake.ustack_id : -1;
    e->cpu = bpf_get_smp_processor_id();
    e->state = preempted ? STATE_PREEMPTED : (s32)state;
    sched_events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_waking)
{
    u32 tid = args->pid;
    if (!is_traced(tid))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct wakeup w = {};
    w.ts_ns = bpf_ktime_get_ns();
    w.waker_tid = (u32)id;
    w.waker_pid = id >> 32;
    w.kstack_id = stacks.get_stackid(args, 0);
    w.ustack_id = stacks.get_stackid(args, BPF_F_USER_STACK);
    woken_at.update(&tid, &w);
    return 0;
}

static __always_inline void emit_task(u32 tid, u32 pid, u32 parent, u32 what, const char *comm)
{
    struct task_event *e = task_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_TASK);
        return;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->tid = tid;
    e->pid = pid;
    e->parent_tid = parent;
    e->what = what;
    if (comm)
        __builtin_memcpy(e->comm, comm, sizeof(e->comm));
    else
        bpf_get_current_comm(e->comm, sizeof(e->comm));
    task_events.ringbuf_submit(e, 0);
}

TRACEPOINT_PROBE(task, task_newtask)
{
    u32 parent = current_tid();
    if (!is_traced(parent))
        return 0;
    u32 child = args->pid;
    int thread = (args->clone_flags & CLONE_THREAD_FLAG) != 0;
    u32 tgid = thread ? current_tgid() : child;
    if (!TRACE_ALL)
        traced.update(&child, &tgid);
    emit_task(child, tgid, parent, thread ? TASK_THREAD : TASK_PROCESS, args->comm);
    return 0;
}

TRACEPOINT_PROBE(task, task_rename)
{
    u32 tid = args->pid;
    u32 *tgid = traced.lookup(&tid);
    if (!tgid && !TRACE_ALL)
        return 0;
    emit_task(tid, tgid ? *tgid : current_tgid(), 0, TASK_RENAME, args->newcomm);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    emit_task(tid, current_tgid(), 0, TASK_EXEC, NULL);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    emit_task(tid, current_tgid(), 0, TASK_EXIT, NULL);
    /* The map entry stays until user space has drained the last intervals; the
     * collector removes exited tids (a tid is not reused within seconds). */
    return 0;
}
