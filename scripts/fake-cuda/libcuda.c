/* A stand-in for the CUDA driver (libcuda.so.1) on machines without a GPU, for the cuda
 * probe's tests.  One simulated device with one queue: a launch enqueues a kernel of
 * fakecuda_set_kernel_ns() nanoseconds ($FAKECUDA_KERNEL_NS, default 1 ms) behind what
 * is queued; a synchronisation sleeps until the queue is empty; a synchronous copy waits
 * for the queue, then takes bytes / 10 GB/s.  Exported names are the real ones, with a
 * few of the versioned aliases libcuda exports (_v2, _ptsz); each is its own function,
 * and none calls another exported one, so a call is one uprobe hit (build.py keeps gcc
 * from folding identical bodies into one address).
 *
 * With $TRAINBPF_SIM_GPU set, the device is the simulated GPU the nvidia-smi and NVML
 * stand-ins sample (scripts/fake-nvidia-smi, scripts/fake-nvml): each kernel appends its
 * busy interval "start_ns end_ns pid\n" (CLOCK_MONOTONIC) to that file, and each process
 * that launches lists its pid once in "<file>.pids" (a CUDA context: a compute process).
 * Copies are not kernels and are not written.
 *
 * Events: an event recorded stays not ready (cuEventQuery returns CUDA_ERROR_NOT_READY,
 * 600) for as many queries as fakecuda_hold_event(event, queries) last set for it
 * ($FAKECUDA_EVENT_QUERIES, default 0, for events never set), counted from each record;
 * a stream wait on an event returns at once. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;
typedef void *CUgraphExec;
typedef uint64_t CUdeviceptr;

#define NOINLINE __attribute__((noinline, used))

static uint64_t busy_until; /* CLOCK_MONOTONIC ns at which the queued work is done */
static uint64_t kernel_ns = 1000000;
static uint64_t next_ptr = 0x700000000000ull;
static int sim_fd = -1;        /* $TRAINBPF_SIM_GPU, O_APPEND; -1: not simulating */
static char sim_pids[4096];    /* "<file>.pids" */
static pid_t sim_registered;   /* the process whose pid "<file>.pids" lists */
#define SIM_FILE_MAX_BYTES (1 << 20) /* past this the file starts afresh: readers read its tail */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t)
{
    struct timespec ts = {.tv_sec = (time_t)(t / 1000000000ull), .tv_nsec = (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
    }
}

static void sim_append(int fd, const char *line, int n)
{
    if (fd < 0 || n <= 0)
        return;
    ssize_t done = write(fd, line, (size_t)n); /* one short write on O_APPEND: never split */
    (void)done;
}

static void sim_busy(uint64_t start, uint64_t end)
{
    char line[80];
    pid_t pid = getpid(), seen = __atomic_load_n(&sim_registered, __ATOMIC_ACQUIRE);
    if (seen != pid && __atomic_compare_exchange_n(&sim_registered, &seen, pid, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        int fd = open(sim_pids, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644); /* also a forked child's */
        sim_append(fd, line, snprintf(line, sizeof line, "%d\n", (int)pid));
        if (fd >= 0)
            close(fd);
    }
    sim_append(sim_fd, line, snprintf(line, sizeof line, "%llu %llu %d\n", (unsigned long long)start,
                                      (unsigned long long)end, (int)pid));
}

static void enqueue(uint64_t ns, int kernel)
{
    uint64_t now = now_ns(), old, start;
    do { /* lock-free: workers in other threads launch too */
        old = __atomic_load_n(&busy_until, __ATOMIC_ACQUIRE);
        start = old > now ? old : now;
    } while (!__atomic_compare_exchange_n(&busy_until, &old, start + ns, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    if (kernel && ns > 0 && sim_fd >= 0)
        sim_busy(start, start + ns);
}

static CUresult drain_queue(void)
{
    sleep_until(__atomic_load_n(&busy_until, __ATOMIC_ACQUIRE));
    return 0;
}

static CUresult copy_sync(size_t bytes)
{
    drain_queue();
    sleep_until(now_ns() + bytes / 10); /* 10 bytes per ns */
    return 0;
}

static CUresult alloc(CUdeviceptr *p, size_t bytes)
{
    if (p)
        *p = __atomic_fetch_add(&next_ptr, (bytes + 255) & ~255ull, __ATOMIC_RELAXED);
    return 0;
}

NOINLINE void fakecuda_set_kernel_ns(uint64_t ns) { __atomic_store_n(&kernel_ns, ns, __ATOMIC_RELAXED); }

#define NOT_READY 600 /* CUDA_ERROR_NOT_READY, as cudaErrorNotReady */
#define EVENTS 64
static struct {
    CUevent event;
    unsigned hold; /* not-ready queries after each record */
    unsigned left; /* of them, still to come */
} events[EVENTS];
static unsigned default_hold;
static pthread_mutex_t events_lock = PTHREAD_MUTEX_INITIALIZER;

/* The event's slot, taken for it on first use (the last slot when all are taken);
 * events_lock held. */
static unsigned event_slot(CUevent e)
{
    unsigned i;
    for (i = 0; i < EVENTS - 1 && events[i].event && events[i].event != e; i++) {
    }
    if (events[i].event != e) {
        events[i].event = e;
        events[i].hold = default_hold;
        events[i].left = 0;
    }
    return i;
}

NOINLINE void fakecuda_hold_event(CUevent e, unsigned queries)
{
    pthread_mutex_lock(&events_lock);
    events[event_slot(e)].hold = queries;
    pthread_mutex_unlock(&events_lock);
}

__attribute__((constructor)) static void init(void)
{
    const char *env = getenv("FAKECUDA_KERNEL_NS");
    if (env)
        kernel_ns = strtoull(env, NULL, 10);
    const char *hold = getenv("FAKECUDA_EVENT_QUERIES");
    if (hold)
        default_hold = (unsigned)strtoul(hold, NULL, 10);
    const char *sim = getenv("TRAINBPF_SIM_GPU");
    struct stat st;
    if (!sim || !*sim || snprintf(sim_pids, sizeof sim_pids, "%s.pids", sim) >= (int)sizeof sim_pids)
        return;
    sim_fd = open(sim, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (sim_fd >= 0 && fstat(sim_fd, &st) == 0 && st.st_size > SIM_FILE_MAX_BYTES) {
        int shrunk = ftruncate(sim_fd, 0); /* readers read the tail only; append anyway if it fails */
        (void)shrunk;
    }
}

NOINLINE CUresult cuInit(unsigned flags) { (void)flags; return 0; }

NOINLINE CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shmem, CUstream stream, void **params, void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)stream;
    (void)params; (void)extra;
    enqueue(__atomic_load_n(&kernel_ns, __ATOMIC_RELAXED), 1);
    return 0;
}

NOINLINE CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                      unsigned by, unsigned bz, unsigned shmem, CUstream stream, void **params,
                                      void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)stream;
    (void)params; (void)extra;
    enqueue(__atomic_load_n(&kernel_ns, __ATOMIC_RELAXED), 1);
    return 0;
}

NOINLINE CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    (void)g; (void)s;
    enqueue(__atomic_load_n(&kernel_ns, __ATOMIC_RELAXED), 1);
    return 0;
}
NOINLINE CUresult cuStreamSynchronize(CUstream s) { (void)s; return drain_queue(); }
NOINLINE CUresult cuStreamSynchronize_ptsz(CUstream s) { (void)s; return drain_queue(); }
NOINLINE CUresult cuCtxSynchronize(void) { return drain_queue(); }
NOINLINE CUresult cuEventSynchronize(CUevent e) { (void)e; return drain_queue(); }
NOINLINE CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { (void)d; (void)s; return copy_sync(n); }
NOINLINE CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { (void)d; (void)s; return copy_sync(n); }
NOINLINE CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { (void)d; (void)s; return copy_sync(n); }
NOINLINE CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    (void)d; (void)s; (void)st;
    enqueue(n / 10, 0);
    return 0;
}
NOINLINE CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    (void)d; (void)s; (void)st;
    enqueue(n / 10, 0);
    return 0;
}
NOINLINE CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return alloc(p, n); }
/* As the real one: a free waits for the device to finish the work queued before it. */
NOINLINE CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return drain_queue(); }
/* Pinning host memory takes the driver a while: long enough to pass min_cuda_ns. */
NOINLINE CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags)
{
    (void)flags;
    sleep_until(now_ns() + 100000);
    return alloc((CUdeviceptr *)p, n);
}
NOINLINE CUresult cuMemFreeHost(void *p)
{
    (void)p;
    sleep_until(now_ns() + 100000);
    return 0;
}

NOINLINE CUresult cuEventRecord(CUevent e, CUstream s)
{
    (void)s;
    pthread_mutex_lock(&events_lock);
    unsigned i = event_slot(e);
    events[i].left = events[i].hold;
    pthread_mutex_unlock(&events_lock);
    return 0;
}

NOINLINE CUresult cuEventQuery(CUevent e)
{
    pthread_mutex_lock(&events_lock);
    unsigned i = event_slot(e);
    CUresult ret = events[i].left ? NOT_READY : 0;
    if (events[i].left)
        events[i].left--;
    pthread_mutex_unlock(&events_lock);
    return ret;
}

NOINLINE CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags)
{
    (void)s; (void)e; (void)flags;
    return 0;
}
