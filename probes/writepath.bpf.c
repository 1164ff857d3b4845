/* The write path of each file a traced thread writes: bytes and calls counted in the
 * kernel per (bucket of DISK_BUCKET_NS, thread, file system device, inode, path).
 *
 * - direct: iomap:iomap_dio_rw_begin (O_DIRECT on an iomap file system: ext4, xfs, ...)
 *   inside a write syscall, or elsewhere (aio, io_uring issuing inline) with IOCB_WRITE
 *   in ki_flags (a write syscall's kiocb does not carry it).
 * - buffered: a write-family syscall (write, pwrite64, writev, pwritev, pwritev2) during
 *   which the file system named the inode it writes (ext4's write_begin events, iomap's
 *   iomap_iter with IOMAP_WRITE) and no direct I/O began; bytes = its return value.  A
 *   write to a pipe, a socket or a file system that names no inode is not counted.
 * - io_uring: io_uring:io_uring_submit_req of a write opcode, in the submitting thread;
 *   the request carries no file, so these count calls with inode 0 and no bytes.  An
 *   O_DIRECT write the submitter issues inline also counts as direct on its file.
 * - mapped: a store into a shared writable mapping of the file.  The thread dirties the
 *   page in its page fault (writeback:writeback_dirty_folio), not in a syscall: calls =
 *   folios dirtied, bytes = PAGE_BYTES each (the event does not say a folio's size);
 *   msync and the kernel's writeback write them out as they do buffered writes. */
#ifndef PROBE_WRITEPATH
#error "PROBE_WRITEPATH must be defined by the loader"
#endif
#ifndef DISK_BUCKET_NS
#error "DISK_BUCKET_NS must be defined by the loader"
#endif
#ifndef WRITE_ENTRIES
#error "WRITE_ENTRIES must be defined by the loader"
#endif
/* Path codes and kernel flag values (tracer/collectors/writepath.py). */
#ifndef WP_BUFFERED
#error "WP_BUFFERED must be defined by the loader"
#endif
#ifndef WP_DIRECT
#error "WP_DIRECT must be defined by the loader"
#endif
#ifndef WP_IO_URING
#error "WP_IO_URING must be defined by the loader"
#endif
#ifndef WP_MAPPED
#error "WP_MAPPED must be defined by the loader"
#endif
#ifndef PAGE_BYTES
#error "PAGE_BYTES must be defined by the loader"
#endif
#ifndef WRITEBACK_DIRTY_FOLIO_NAME_AT
#error "WRITEBACK_DIRTY_FOLIO_NAME_AT must be defined by the loader"
#endif
#ifndef WRITEBACK_DIRTY_FOLIO_INO_AT
#error "WRITEBACK_DIRTY_FOLIO_INO_AT must be defined by the loader"
#endif
#ifndef IOCB_WRITE_FLAG
#error "IOCB_WRITE_FLAG must be defined by the loader"
#endif
#ifndef IOMAP_WRITE_FLAG
#error "IOMAP_WRITE_FLAG must be defined by the loader"
#endif
#ifndef IO_URING_WRITE_OPS
#error "IO_URING_WRITE_OPS must be defined by the loader"
#endif

struct write_key {
    u64 bucket;
    u64 ino;
    u32 tid;
    u32 pid;
    u32 dev; /* the file system's device, kernel dev_t (major << 20 | minor) */
    u32 path;
};

struct write_count {
    u64 bytes;
    u64 calls;
};

/* A traced thread's write syscall in progress: the file it writes, once named. */
struct write_call {
    u64 ino;
    u32 dev;
    u32 pid;
    u32 direct;
    u32 pad;
};

BPF_HASH(write_counts, struct write_key, struct write_count, WRITE_ENTRIES);
BPF_HASH(write_calls, u32, struct write_call, MAX_THREADS);

static __always_inline void count_write(u32 tid, u32 pid, u32 dev, u64 ino, u32 path, u64 bytes)
{
    struct write_key key = {.bucket = bpf_ktime_get_ns() / DISK_BUCKET_NS, .ino = ino, .tid = tid, .pid = pid,
                            .dev = dev, .path = path};
    struct write_count zero = {};
    struct write_count *n = write_counts.lookup_or_try_init(&key, &zero);
    if (!n) {
        count_lost(PROBE_WRITEPATH);
        return;
    }
    __sync_fetch_and_add(&n->bytes, bytes);
    __sync_fetch_and_add(&n->calls, 1);
}

static __always_inline int write_enter(void)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct write_call call = {.pid = current_tgid()};
    write_calls.update(&tid, &call);
    return 0;
}

static __always_inline int write_exit(long ret)
{
    u32 tid = current_tid();
    struct write_call *c = write_calls.lookup(&tid);
    if (!c)
        return 0;
    struct write_call call = *c;
    write_calls.delete(&tid);
    if (ret > 0 && call.ino)
        count_write(tid, call.pid, call.dev, call.ino, call.direct ? WP_DIRECT : WP_BUFFERED, ret);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_write) { return write_enter(); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64) { return write_enter(); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return write_enter(); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev) { return write_enter(); }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return write_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwrite64) { return write_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return write_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwritev) { return write_exit(args->ret); }
/* pwritev2 (what Python's os.pwritev calls): its format's rwf_t is a type bcc's headers
 * lack, so TRACEPOINT_PROBE cannot declare its arguments; named for bcc's attach by
 * tracepoint name, with the exit's layout (common fields, __syscall_nr, ret) declared here. */
struct syscall_exit_args {
    u64 common;
    s64 syscall_nr;
    s64 ret;
};
int tracepoint__syscalls__sys_enter_pwritev2(void *ctx) { return write_enter(); }
int tracepoint__syscalls__sys_exit_pwritev2(struct syscall_exit_args *args) { return write_exit(args->ret); }

/* The file a write syscall in progress writes, from the first event that names it. */
static __always_inline int name_file(u32 dev, u64 ino)
{
    u32 tid = current_tid();
    struct write_call *c = write_calls.lookup(&tid);
    if (c && !c->ino) {
        c->dev = dev;
        c->ino = ino;
    }
    return 0;
}

#ifdef HAVE_TP_EXT4_EXT4_DA_WRITE_BEGIN
TRACEPOINT_PROBE(ext4, ext4_da_write_begin) { return name_file(args->dev, args->ino); }
#endif
#ifdef HAVE_TP_EXT4_EXT4_WRITE_BEGIN
TRACEPOINT_PROBE(ext4, ext4_write_begin) { return name_file(args->dev, args->ino); }
#endif
#ifdef HAVE_TP_IOMAP_IOMAP_ITER
TRACEPOINT_PROBE(iomap, iomap_iter)
{
    if (!(args->flags & IOMAP_WRITE_FLAG))
        return 0;
    return name_file(args->dev, args->ino);
}
#endif

#ifdef HAVE_TP_IOMAP_IOMAP_DIO_RW_BEGIN
TRACEPOINT_PROBE(iomap, iomap_dio_rw_begin)
{
    u32 tid = current_tid();
    struct write_call *c = write_calls.lookup(&tid);
    if (c) { /* counted when the syscall returns, with the bytes it wrote */
        c->dev = args->dev;
        c->ino = args->ino;
        c->direct = 1;
        return 0;
    }
    /* aio or io_uring issuing inline: they mark writes, a write syscall does not */
    if ((args->ki_flags & IOCB_WRITE_FLAG) && is_traced(tid))
        count_write(tid, current_tgid(), args->dev, args->ino, WP_DIRECT, args->count);
    return 0;
}
#endif

#ifdef HAVE_TP_IO_URING_IO_URING_SUBMIT_REQ
TRACEPOINT_PROBE(io_uring, io_uring_submit_req)
{
    u64 op = args->opcode;
    if (op >= 64 || !((IO_URING_WRITE_OPS >> op) & 1))
        return 0;
    u32 tid = current_tid();
    if (is_traced(tid))
        count_write(tid, current_tgid(), 0, 0, WP_IO_URING, 0);
    return 0;
}
#endif

/* The kernel dev_t of a backing device's name "MAJ:MIN" (a block device's or an anonymous
 * one's: nfs, fuse); 0 for any other name (btrfs' "btrfs-N"). */
static __always_inline u32 bdi_dev(const char name[16])
{
    u32 major = 0, minor = 0, colon = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        char ch = name[i];
        if (ch == 0)
            return colon && i > colon + 1 ? (major << 20) | minor : 0;
        if (ch == ':' && !colon && i > 0) {
            colon = i;
        } else if (ch >= '0' && ch <= '9') {
            if (colon)
                minor = minor * 10 + (ch - '0');
            else
                major = major * 10 + (ch - '0');
        } else {
            return 0;
        }
    }
    return 0;
}

/* A folio dirtied outside any syscall: a store's page fault in a shared mapping.  The
 * registers saved at kernel entry tell: a syscall saves its number in orig_ax (the
 * ptrace ABI's layout, which uprobes' PT_REGS_* read as well), an exception or an
 * interrupt -1.  A write, io_uring_enter, copy_file_range or truncate that dirties
 * folios keeps its number.  Not TRACEPOINT_PROBE: probes/writeback.bpf.c holds that name
 * (and bcc's struct of the event's fields), so the fields are read at the offsets the
 * loader took from tracefs, and the collector attaches it. */
int writepath_dirty_folio(void *ctx)
{
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
#if defined(__x86_64__)
    long nr = 0;
    bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_ax);
#elif defined(__aarch64__)
    int nr = 0; /* arm64 keeps it in an s32; NO_SYSCALL is -1 too */
    bpf_probe_read_kernel(&nr, sizeof(nr), &regs->syscallno);
#else
    long nr = 0; /* elsewhere: no write is counted as mapped */
#endif
    if (nr != -1)
        return 0;
    char bdi[16] = {};
    u64 ino = 0;
    bpf_probe_read_kernel(bdi, sizeof(bdi), (char *)ctx + WRITEBACK_DIRTY_FOLIO_NAME_AT);
    bpf_probe_read_kernel(&ino, sizeof(ino), (char *)ctx + WRITEBACK_DIRTY_FOLIO_INO_AT);
    count_write(tid, current_tgid(), bdi_dev(bdi), ino, WP_MAPPED, PAGE_BYTES);
    return 0;
}
