/* CPython frames of the current thread, walked where the probes take user stacks
 * (sched: switch-out and waker; futex: the wait; oncpu: the sample), compiled in with
 * -DPYTHON_FRAMES=1 (record --python-frames).  Without it py_stack() is a constant -1.
 *
 * A thread that released the GIL (one that waits) has no thread-local state pointer, so
 * user space (tracer/symbols/pystacks.py) fills py_threads with each thread's PyThreadState from
 * the interpreter's thread list, and py_layouts with each process's offsets, checked by a
 * self-test first (tracer/symbols/pyruntime.py, docs/python-frames.md).  The walk reads the
 * current frame, then follows `previous` for at most PY_MAX_FRAMES Python frames,
 * keeping each frame's code object and instruction pointer; user space names them (file,
 * function, line) once per code object while the process lives.
 *
 * Stacks are interned in the kernel: a hash of the walked content finds an earlier copy
 * in py_stack_index, else the stack takes the next free slot of this CPU in py_stacks
 * (slot = n * PY_CPUS + cpu, so CPUs never share a slot and no atomics are needed), and
 * the event carries PY_STACK_ID_BASE + slot.  User space reads each CPU's new slots at
 * every flush. */
#ifndef TRAINBPF_PYFRAMES_H
#define TRAINBPF_PYFRAMES_H

#ifndef PYTHON_FRAMES
#error "PYTHON_FRAMES must be defined by the loader"
#endif
#define PY_STACK_NONE -1

/* The walk's sizes come from tracer/symbols/pystacks.py (PY_MAX_FRAMES, a power of two;
 * PY_PROCESSES; PY_FRAME_BYTES) and the loader (PY_STACK_ENTRIES, PY_CPUS). */
#if PYTHON_FRAMES
#ifndef PY_MAX_FRAMES
#error "PY_MAX_FRAMES must be defined by the loader"
#endif
#ifndef PY_STACK_ENTRIES
#error "PY_STACK_ENTRIES must be defined by the loader"
#endif
#ifndef PY_CPUS
#error "PY_CPUS must be defined by the loader"
#endif
#ifndef PY_STACK_ID_BASE
#error "PY_STACK_ID_BASE must be defined by the loader"
#endif
#ifndef PY_PROCESSES
#error "PY_PROCESSES must be defined by the loader"
#endif
/* Bytes read per frame, holding every field the walk needs; a power of two, so offsets
 * can be masked (tracer/symbols/pystacks.py FRAME_WINDOW). */
#ifndef PY_FRAME_BYTES
#error "PY_FRAME_BYTES must be defined by the loader"
#endif
/* Entry frames owned by the C stack (3.12+) hold no Python code. */
#define PY_FRAME_OWNED_BY_CSTACK 3

/* Where a process's frames are: tracer/symbols/pystacks.py fills it from tracer/symbols/pyruntime.py. */
struct py_layout {
    s32 ts_cframe;     /* >= 0: frame = *(*(tstate + ts_cframe) + current_frame) (3.11, 3.12) */
    u32 current_frame; /* else frame = *(tstate + current_frame) */
    u32 frame_bytes;   /* bytes read per frame: the largest field's end, <= PY_FRAME_BYTES */
    u32 previous;      /* offsets inside a frame */
    u32 code;
    u32 instr;
    s32 owner;         /* < 0: frames have no owner byte (3.10, 3.11) */
    u32 pad;
    u64 instr_mask;    /* 3.10's f_lasti is an int, the later pointers 64 bits */
};

/* A walked stack, innermost frame first. */
struct py_stack {
    u32 pid;
    u32 depth;
    u64 code[PY_MAX_FRAMES];
    u64 instr[PY_MAX_FRAMES];
};

struct py_scratch {
    struct py_stack stack;
    u8 frame[PY_FRAME_BYTES + 8]; /* + 8: a masked offset may start a u64 at the last byte */
};

BPF_HASH(py_layouts, u32, struct py_layout, PY_PROCESSES);
BPF_HASH(py_threads, u32, u64, MAX_THREADS); /* tid -> PyThreadState address */
BPF_HASH(py_stack_index, u64, s32, PY_STACK_ENTRIES); /* content hash -> slot */
BPF_ARRAY(py_stacks, struct py_stack, PY_STACK_ENTRIES);
BPF_PERCPU_ARRAY(py_slots_used, u32, 1);
BPF_PERCPU_ARRAY(py_scratch_space, struct py_scratch, 1);
/* [0] walks of a thread with a known thread state, [1] of them with no readable frame,
 * [2] new stacks lost because this CPU's slots were used up */
BPF_PERCPU_ARRAY(py_counts, u64, 3);

static __always_inline void py_count(u32 slot)
{
    u64 *n = py_counts.lookup(&slot);
    if (n)
        (*n)++;
}

static __always_inline u64 py_word(const u8 *frame, u32 off)
{
    return *(const u64 *)(frame + (off & (PY_FRAME_BYTES - 1)));
}

/* FNV-1a over 64-bit words: the stack's identity for interning. */
static __always_inline u64 py_mix(u64 hash, u64 word)
{
    return (hash ^ word) * 0x100000001b3ULL;
}

/* The current thread's Python stack id, or PY_STACK_NONE. */
static __always_inline s32 py_stack(void)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, pid = id >> 32;
    u64 *tstate = py_threads.lookup(&tid);
    if (!tstate)
        return PY_STACK_NONE;
    struct py_layout *l = py_layouts.lookup(&pid);
    u32 zero = 0;
    struct py_scratch *s = py_scratch_space.lookup(&zero);
    if (!l || !s)
        return PY_STACK_NONE;
    py_count(0);
    u64 frame = 0, holder = *tstate;
    if (l->ts_cframe >= 0 && bpf_probe_read_user(&holder, sizeof(holder), (void *)(*tstate + l->ts_cframe)))
        holder = 0;
    if (!holder || bpf_probe_read_user(&frame, sizeof(frame), (void *)(holder + l->current_frame)))
        frame = 0;
    u32 size = l->frame_bytes;
    if (size > PY_FRAME_BYTES)
        size = PY_FRAME_BYTES;
    u64 hash = py_mix(0xcbf29ce484222325ULL, pid);
    u32 depth = 0;
    /* Twice the frames: entry frames owned by the C stack are passed over, not kept. */
#pragma unroll
    for (int i = 0; i < 2 * PY_MAX_FRAMES; i++) {
        if (!frame || depth >= PY_MAX_FRAMES || !size)
            break;
        if (bpf_probe_read_user(s->frame, size, (void *)frame))
            break;
        if (l->owner < 0 || s->frame[l->owner & (PY_FRAME_BYTES - 1)] != PY_FRAME_OWNED_BY_CSTACK) {
            u64 code = py_word(s->frame, l->code);
            u64 instr = py_word(s->frame, l->instr) & l->instr_mask;
            s->stack.code[depth & (PY_MAX_FRAMES - 1)] = code;
            s->stack.instr[depth & (PY_MAX_FRAMES - 1)] = instr;
            hash = py_mix(py_mix(hash, code), instr);
            depth++;
        }
        frame = py_word(s->frame, l->previous);
    }
    if (!depth) {
        py_count(1);
        return PY_STACK_NONE;
    }
    hash = py_mix(hash, depth);
    s32 *known = py_stack_index.lookup(&hash);
    if (known)
        return PY_STACK_ID_BASE + *known;
    u32 *used = py_slots_used.lookup(&zero);
    if (!used)
        return PY_STACK_NONE;
    u32 slot = *used * PY_CPUS + bpf_get_smp_processor_id();
    if (slot >= PY_STACK_ENTRIES) {
        py_count(2);
        return PY_STACK_NONE;
    }
    struct py_stack *stored = py_stacks.lookup(&slot);
    if (!stored)
        return PY_STACK_NONE;
    s->stack.pid = pid;
    s->stack.depth = depth;
    __builtin_memcpy(stored, &s->stack, sizeof(*stored));
    s32 index = slot;
    py_stack_index.update(&hash, &index);
    /* Counted last: user space reads only slots below the count, so it never sees a
     * slot being written (x86-64 keeps stores in order). */
    *used += 1;
    return PY_STACK_ID_BASE + index;
}
#else
static __always_inline s32 py_stack(void)
{
    return PY_STACK_NONE;
}
#endif

#endif
