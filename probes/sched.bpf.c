/* Off-CPU intervals of traced threads (sched_switch), the wake-up that ended each
 * (sched_waking runs in the waker's context, unlike sched_wakeup), and the thread table
 * (task_newtask / task_rename / sched_process_exec / sched_process_exit).
 *
 * Intervals >= MIN_BLOCK_NS stream out with stacks; shorter ones are summed in the kernel
 * per (tid, state) so every nanosecond stays accounted for without flooding user space.
 * Preemptions of traced threads are counted per (traced tid, the task that ran instead),
 * with that task's comm from the tracepoint: what took the CPU, in the tree or not.
 *
 * Stacks cost most (docs/performance.md) and only streamed intervals keep them.
 * Where the kernel has the bare sched_exit_tp tracepoint (6.16+; the loader then defines
 * HAVE_RAW_TP_SCHED_EXIT_TP) they are taken at switch-in, once the length is known:
 * sched_exit_tp fires at the end of __schedule in the task just switched in, whose kernel
 * and user stacks are still those it switched out with.  sched_switch parks the interval
 * in a per-CPU slot; sched_exit_tp, next on that CPU, adds the stacks and emits it.
 * Elsewhere the stacks are taken at every switch-out. */
#ifndef MIN_BLOCK_NS
#error "MIN_BLOCK_NS must be defined by the loader"
#endif

/* task_events' ring buffer, in pages (tracer/collectors/sched.py TASK_RINGBUF_PAGES). */
#ifndef TASK_RINGBUF_PAGES
#error "TASK_RINGBUF_PAGES must be defined by the loader"
#endif

/* From tracer/collectors/sched.py: STATE_PREEMPTED (TASK_REPORT_MAX: switched out while runnable),
 * and the TASK_* codes of task_event.what. */
#ifndef PROBE_SCHED
#error "PROBE_SCHED must be defined by the loader"
#endif
#ifndef PROBE_TASK
#error "PROBE_TASK must be defined by the loader"
#endif
#ifndef STATE_PREEMPTED
#error "STATE_PREEMPTED must be defined by the loader"
#endif
#ifndef TASK_THREAD
#error "TASK_THREAD must be defined by the loader"
#endif
#ifndef TASK_PROCESS
#error "TASK_PROCESS must be defined by the loader"
#endif
#ifndef TASK_EXEC
#error "TASK_EXEC must be defined by the loader"
#endif
#ifndef TASK_RENAME
#error "TASK_RENAME must be defined by the loader"
#endif
#ifndef TASK_EXIT
#error "TASK_EXIT must be defined by the loader"
#endif
/* 1 under sudo (Settings.exec_leaves): an exec takes the process out of the traced set. */
#ifndef EXEC_LEAVES
#error "EXEC_LEAVES must be defined by the loader"
#endif
/* (traced tid, next tid) pairs one flush can count (tracer/collectors/sched.py PREEMPTION_ENTRIES). */
#ifndef PREEMPTION_ENTRIES
#error "PREEMPTION_ENTRIES must be defined by the loader"
#endif
#define CLONE_THREAD_FLAG 0x00010000

struct offcpu_event {
    u64 ts_ns;   /* switch-out */
    u64 dur_ns;  /* switch-out -> switch-in */
    u64 runq_ns; /* wake-up (or preemption) -> switch-in */
    u32 tid;
    u32 pid;
    u32 peer_tid;
    u32 peer_pid;
    s32 kstack_id;
    s32 ustack_id;
    s32 peer_kstack_id;
    s32 cpu;   /* where it ran next */
    s32 state; /* prev_state at switch-out; 0 or STATE_PREEMPTED = preempted */
    s32 pystack_id;       /* probes/pyframes.h: PY_STACK_NONE without Python frames */
    s32 peer_pystack_id;
};

struct task_event {
    u64 ts_ns;
    u32 tid;
    u32 pid;
    u32 peer_tid;
    u32 event; /* TASK_* */
    char comm[16];
};

/* What sched_switch and sched_waking keep of each traced thread, in one entry: its last
 * switch-out and the last wake-up since.  One entry, not one map each, because each hash
 * lookup here costs ~0.3-0.4 us (the switch has just emptied the caches; measured in
 * docs/performance.md): a switch now looks a thread up once, a wake-up once.  Created at
 * a traced thread's first switch-out and kept until it exits (user space removes it), so
 * an entry also says the thread is traced.  Rewritten in place, never replaced: a hash
 * update or delete at every switch costs an element's allocation and free. */
struct switched_out {
    u64 ts_ns; /* 0 once it has run again */
    s64 state;
    s32 kstack_id;
    s32 ustack_id;
    u32 tgid; /* read at switch-out, where the task is `current` */
    s32 pystack_id;
};

struct wakeup {
    u64 ts_ns; /* older than out.ts_ns: a wake-up before the last switch-out, ignored */
    u32 peer_tid;
    u32 peer_pid;
    s32 kstack_id;
    s32 pystack_id;
};

struct sched_thread {
    struct switched_out out;
    struct wakeup woken;
};

struct short_key {
    u32 tid;
    u32 state;
};

struct short_sum {
    u64 intervals;
    u64 dur_ns;
    u64 runq_ns;
    u32 pid;
    u32 pad;
};

struct preempt_key {
    u32 tid;      /* the traced thread switched out while runnable */
    u32 peer_tid; /* the task that ran instead (the tracepoint's next_pid) */
};

struct preemption {
    u64 preemptions;
    u32 pid; /* the traced thread's tgid */
    u32 pad;
    char comm[16]; /* next_comm at the first preemption since the last drain */
};

BPF_RINGBUF_OUTPUT(sched_events, RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(task_events, TASK_RINGBUF_PAGES);
BPF_HASH(sched_threads, u32, struct sched_thread, MAX_THREADS);
/* Drained whole at every flush, and a drain walks every bucket (~5 ns each, used or not):
 * sized by the loader for what one second can hold (SchedCollector.defines). */
#ifndef SHORT_WAIT_ENTRIES
#error "SHORT_WAIT_ENTRIES must be defined by the loader"
#endif
BPF_HASH(short_waits, struct short_key, struct short_sum, SHORT_WAIT_ENTRIES);
/* Drained whole at every flush, like short_waits. */
BPF_HASH(preemptions, struct preempt_key, struct preemption, PREEMPTION_ENTRIES);
/* Where a tracepoint program's arguments lie on this CPU in task context: sched_switch
 * (always task context) notes it.  The kernel fills tracepoint arguments into one
 * per-CPU buffer per context (task, softirq, hardirq, NMI: perf_trace_buf_alloc), so a
 * wake-up whose arguments lie elsewhere ran in interrupt context, where `current` is
 * whoever was interrupted, not a waker.  0: not noted yet on this CPU. */
BPF_PERCPU_ARRAY(task_context_args, u64, 1);
#ifdef HAVE_RAW_TP_SCHED_EXIT_TP
/* The interval of the task being switched in on this CPU, until sched_exit_tp; tid 0: empty. */
BPF_PERCPU_ARRAY(switching_in, struct offcpu_event, 1);
#endif

/* A traced thread `prev` (of tgid `pid`) preempted by `next`: one hash lookup, on
 * preemptions only; the value is made whole before it is inserted, comm included. */
static __always_inline void count_preemption(u32 prev, u32 pid, u32 next, const char *next_comm)
{
    struct preempt_key key = {.tid = prev, .peer_tid = next};
    struct preemption fresh = {.pid = pid};
    __builtin_memcpy(fresh.comm, next_comm, sizeof(fresh.comm));
    struct preemption *p = preemptions.lookup_or_try_init(&key, &fresh);
    if (!p) { /* full: more pairs this second than it holds */
        count_lost(PROBE_SCHED);
        return;
    }
    p->preemptions += 1;
}

static __always_inline void emit_offcpu(struct offcpu_event *ev, s32 kstack, s32 ustack, s32 pystack)
{
    struct offcpu_event *e = sched_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_SCHED);
        return;
    }
    *e = *ev;
    e->kstack_id = kstack;
    e->ustack_id = ustack;
    e->pystack_id = pystack;
    sched_events.ringbuf_submit(e, submit_flags(PROBE_SCHED));
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    u32 zero = 0;
    u64 *task_args = task_context_args.lookup(&zero);
    if (task_args)
        *task_args = (u64)args;

    if (prev != 0) {
        /* An entry says the thread is traced; only a thread without one is looked up in
         * `traced` (its first switch-out, or an untraced thread). */
        struct sched_thread *t = sched_threads.lookup(&prev);
        struct sched_thread fresh = {};
        if (!t && is_traced(prev))
            t = &fresh;
        if (t) {
            struct switched_out *out = &t->out;
            out->tgid = current_tgid();
            out->state = args->prev_state;
            /* Runnable at switch-out: something else took the CPU (never the idle task). */
            if ((out->state == 0 || out->state == STATE_PREEMPTED) && next != 0)
                count_preemption(prev, out->tgid, next, args->next_comm);
#ifdef HAVE_RAW_TP_SCHED_EXIT_TP
            out->kstack_id = -1;
            out->ustack_id = -1;
            out->pystack_id = PY_STACK_NONE;
#else
            out->kstack_id = stack_id(args, 0);
            out->ustack_id = stack_id(args, BPF_F_USER_STACK);
            out->pystack_id = py_stack();
#endif
            out->ts_ns = now; /* last: a reader that sees it sees the rest */
            if (t == &fresh && sched_threads.update(&prev, &fresh)) /* full: more threads than it holds */
                count_lost(PROBE_SCHED);
        }
    }
    if (next == 0)
        return 0;
    struct sched_thread *t = sched_threads.lookup(&next);
    if (!t || !t->out.ts_ns)
        return 0;
    struct switched_out *so = &t->out;
    u64 dur = now - so->ts_ns;
    s64 state = so->state;
    int preempted = state == 0 || state == STATE_PREEMPTED;
    u64 runq = preempted ? dur : 0;
    struct wakeup wake = {};
    if (t->woken.ts_ns >= so->ts_ns) {
        wake = t->woken;
        /* A wake-up stamped after `now` raced this switch-in from another CPU: no queue. */
        if (!preempted)
            runq = now > wake.ts_ns ? now - wake.ts_ns : 0;
    }
    s32 kstack = so->kstack_id, ustack = so->ustack_id, pystack = so->pystack_id;
    u32 pid = so->tgid;
    so->ts_ns = 0; /* running: the interval is taken */
    /* The wake-up stays: one older than the next switch-out is ignored. */

    if (dur < MIN_BLOCK_NS) {
        struct short_key key = {.tid = next, .state = preempted ? STATE_PREEMPTED : (u32)(state & 0xff)};
        struct short_sum zero = {};
        struct short_sum *sum = short_waits.lookup_or_try_init(&key, &zero);
        if (!sum) { /* full: more (thread, state) pairs waited briefly this second than it holds */
            count_lost(PROBE_SCHED);
            return 0;
        }
        sum->intervals += 1;
        sum->dur_ns += dur;
        sum->runq_ns += runq;
        sum->pid = pid;
        return 0;
    }
    struct offcpu_event ev = {};
    ev.ts_ns = now - dur;
    ev.dur_ns = dur;
    ev.runq_ns = runq;
    ev.tid = next;
    ev.pid = pid;
    ev.peer_tid = wake.peer_tid;
    ev.peer_pid = wake.peer_pid;
    ev.peer_kstack_id = wake.ts_ns ? wake.kstack_id : -1;
    ev.peer_pystack_id = wake.ts_ns ? wake.pystack_id : PY_STACK_NONE;
    ev.cpu = bpf_get_smp_processor_id();
    ev.state = preempted ? STATE_PREEMPTED : (s32)state;
#ifdef HAVE_RAW_TP_SCHED_EXIT_TP
    struct offcpu_event *slot = switching_in.lookup(&zero);
    if (!slot)
        return 0;
    if (slot->tid) /* never picked up: a new task's first run skips sched_exit_tp */
        emit_offcpu(slot, -1, -1, PY_STACK_NONE);
    *slot = ev;
#else
    emit_offcpu(&ev, kstack, ustack, pystack);
#endif
    return 0;
}

#ifdef HAVE_RAW_TP_SCHED_EXIT_TP
/* A raw tracepoint's kernel stack starts with this program and bpf_trace_run1; skipped,
 * it starts at __schedule like one taken in sched_switch. */
#define RAW_TP_SKIP_FRAMES 2

/* End of __schedule, in the task now running: the interval sched_switch parked on this
 * CPU gets this task's stacks, which are still those it switched out with. */
RAW_TRACEPOINT_PROBE(sched_exit_tp)
{
    u32 zero = 0;
    struct offcpu_event *slot = switching_in.lookup(&zero);
    if (!slot || !slot->tid)
        return 0;
    if (slot->tid == current_tid())
        emit_offcpu(slot, stack_id(ctx, RAW_TP_SKIP_FRAMES), stack_id(ctx, BPF_F_USER_STACK), py_stack());
    else
        emit_offcpu(slot, -1, -1, PY_STACK_NONE);
    slot->tid = 0;
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_waking)
{
    /* Node-wide, the recorder's own wake-ups stay out (is_traced's rule). */
    if (TRACE_ALL && current_tgid() == SELF_TGID)
        return 0;
    u32 tid = args->pid;
    /* No entry: not traced.  Not switched out (still running, or never seen): sched_switch
     * ignores a wake-up that comes before the switch-out, so there is nothing to keep. */
    struct sched_thread *t = sched_threads.lookup(&tid);
    if (!t || !t->out.ts_ns)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u64 so_ts = t->out.ts_ns;
    /* Written in place: wake-ups of one thread are serialised (try_to_wake_up holds its
     * pi_lock) and it is not switched in before its wake-up ends, so only user space's
     * map reads can meet a half-written wake-up. */
    struct wakeup w = {};
    w.ts_ns = bpf_ktime_get_ns();
    w.peer_tid = (u32)id;
    w.peer_pid = id >> 32;
    /* The analysis names a producer by its Python stack at its wake-ups where its own
     * samples and switch-outs show none (analyzers/findings/python_ends.py): the waker's Python stack
     * is taken, for a wait already long enough to stream.  Its native user stack is not:
     * nothing reads it, and its walk was most of this program's cost.  The kernel stack
     * is taken for a wake-up from interrupt context, where it shows what woke the thread
     * (a timer, an I/O completion) and tells user space to drop the "waker"; and where
     * this CPU's task-context argument buffer is not known yet, since then only the stack
     * can tell (user space looks for irq frames). */
    u32 zero = 0;
    u64 *task_args = task_context_args.lookup(&zero);
    int known = task_args && *task_args;
    int in_task = known && *task_args == (u64)args;
    int in_irq = known && !in_task;
    int long_wait = w.ts_ns - so_ts >= MIN_BLOCK_NS;
    w.kstack_id = in_task ? -1 : stack_id(args, 0);
    w.pystack_id = long_wait && !in_irq ? py_stack() : PY_STACK_NONE;
    t->woken = w;
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
    e->peer_tid = parent;
    e->event = what;
    if (comm)
        __builtin_memcpy(e->comm, comm, sizeof(e->comm));
    else
        bpf_get_current_comm(e->comm, sizeof(e->comm));
    task_events.ringbuf_submit(e, 0); /* rare: the default wake-up is cheap */
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
    /* Under sudo the new program may be one the user cannot trace (setuid): the process
     * leaves here, before that program runs, and user space lets it back in only if the
     * user could still ptrace it (tracer/access.py).  Its entry in sched_threads would
     * keep it traced too.  A thread other than the leader that execs takes the tgid. */
    if (EXEC_LEAVES) {
        u32 old = args->old_pid;
        traced.delete(&tid);
        traced.delete(&old);
        sched_threads.delete(&tid);
    }
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
