/* bcc's offcputime (tools/offcputime.py, `offcputime -p PID`) moved from its kprobe on
 * finish_task_switch to the sched_switch tracepoint, for kernels without kprobes: the
 * comparator of bench_overhead.py.  Same method: every switch-out of a thread of the
 * target stores a start time; every switch-in takes the thread's user and kernel stack
 * ids and adds the off-CPU microseconds to an in-kernel sum keyed by (pid, tgid,
 * stacks, comm).  The one change the tracepoint forces: at sched_switch only the
 * outgoing task is `current`, so its stacks are taken at switch-out (they are the same
 * stacks offcputime reads at switch-in) and kept with the start time. */
#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

#ifndef TARGET_TGID
#define TARGET_TGID 0
#endif
#ifndef STACK_STORAGE_SIZE
#define STACK_STORAGE_SIZE 1024 /* offcputime's --stack-storage-size default */
#endif
#define MINBLOCK_US 1ULL          /* offcputime's -m default */
#define MAXBLOCK_US 0xffffffffffffffffULL

struct key_t {
    u32 pid;
    u32 tgid;
    int user_stack_id;
    int kernel_stack_id;
    char name[TASK_COMM_LEN];
};

struct start_t {
    u64 ts;
    int user_stack_id;
    int kernel_stack_id;
};

BPF_HASH(counts, struct key_t);
BPF_HASH(start, u32, struct start_t);
BPF_STACK_TRACE(stack_traces, STACK_STORAGE_SIZE);

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 prev = args->prev_pid;
    u32 tgid = id >> 32;

    /* record previous thread sleep time (and, here, its stacks) */
    if (prev != 0 && tgid == TARGET_TGID) {
        struct start_t s = {};
        s.ts = bpf_ktime_get_ns();
        s.user_stack_id = stack_traces.get_stackid(args, BPF_F_USER_STACK);
        s.kernel_stack_id = stack_traces.get_stackid(args, 0);
        start.update(&prev, &s);
    }

    /* the incoming thread's start time */
    u32 pid = args->next_pid;
    struct start_t *sp = start.lookup(&pid);
    if (sp == 0)
        return 0; /* missed start or filtered */
    struct start_t s = *sp;
    u64 t_end = bpf_ktime_get_ns();
    start.delete(&pid);
    if (s.ts > t_end)
        return 0;
    u64 delta = (t_end - s.ts) / 1000;
    if (delta < MINBLOCK_US || delta > MAXBLOCK_US)
        return 0;

    struct key_t key = {};
    key.pid = pid;
    key.tgid = TARGET_TGID;
    key.user_stack_id = s.user_stack_id;
    key.kernel_stack_id = s.kernel_stack_id;
    __builtin_memcpy(&key.name, args->next_comm, sizeof(key.name));
    counts.increment(key, delta);
    return 0;
}
