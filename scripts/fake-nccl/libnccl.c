/* A stand-in for NCCL (libnccl.so.2) whose collectives really wait for the other ranks,
 * as blocking collectives do: the ranks of a communicator share a process-shared
 * pthread barrier in a file, so the rank that arrives last waits least and the others
 * wait for it.  No data moves: the stand-in only synchronises.
 *
 * The unique id holds the file's path (ncclGetUniqueId makes one; any process may
 * write a path of its own into an id).  ncclCommInitRank, collective itself as NCCL's
 * is, maps the file, the first rank there sets the barrier up, and rank 0 removes the
 * file once every rank has mapped it.  Calls between ncclGroupStart and ncclGroupEnd
 * return at once and ncclGroupEnd waits for them (for the last communicator used);
 * ncclSend and ncclRecv synchronise the whole communicator, so every rank takes part in
 * each exchange.  Signatures are nccl.h's; each call also has its profiling name
 * (pncclAllReduce, ...) at the same address, as NCCL's builds have. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline, used))
#define PROFILING_NAME(name) __attribute__((alias(#name), used))

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
} ncclResult_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void *cudaStream_t;

enum { FRESH, SETTING_UP, READY };

struct shared {
    atomic_int state;
    int nranks;
    pthread_barrier_t barrier;
};

struct ncclComm {
    struct shared *shared;
    int rank;
    int nranks;
};
typedef struct ncclComm *ncclComm_t;

static __thread int group_depth;
static __thread ncclComm_t group_comm; /* the communicator the open group waits on */

NOINLINE ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return ncclInvalidArgument;
    *version = 22105; /* 2.21.5 */
    return ncclSuccess;
}

NOINLINE const char *ncclGetErrorString(ncclResult_t result)
{
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclSystemError: return "unhandled system error";
    default: return "unknown result code";
    }
}

NOINLINE ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id)
        return ncclInvalidArgument;
    memset(id, 0, sizeof(*id));
    const char *dir = getenv("TMPDIR");
    snprintf(id->internal, sizeof(id->internal), "%s/fakenccl-XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(id->internal);
    if (fd < 0)
        return ncclSystemError;
    close(fd);
    return ncclSuccess;
}

/* The shared barrier of the file named by `id`, set up by whichever rank maps it first. */
static struct shared *rendezvous(const ncclUniqueId *id, int nranks)
{
    if (!memchr(id->internal, 0, sizeof(id->internal)) || !id->internal[0])
        return NULL;
    int fd = open(id->internal, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return NULL;
    struct shared *s = MAP_FAILED;
    if (ftruncate(fd, sizeof(*s)) == 0) /* zeros: FRESH */
        s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (s == MAP_FAILED)
        return NULL;
    int fresh = FRESH;
    if (atomic_compare_exchange_strong(&s->state, &fresh, SETTING_UP)) {
        pthread_barrierattr_t attr;
        pthread_barrierattr_init(&attr);
        pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
        pthread_barrier_init(&s->barrier, &attr, (unsigned)nranks);
        pthread_barrierattr_destroy(&attr);
        s->nranks = nranks;
        atomic_store(&s->state, READY);
    }
    while (atomic_load(&s->state) != READY)
        usleep(1000);
    if (s->nranks != nranks) {
        munmap(s, sizeof(*s));
        return NULL;
    }
    return s;
}

NOINLINE ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks)
        return ncclInvalidArgument;
    struct shared *s = rendezvous(&id, nranks);
    if (!s)
        return ncclSystemError;
    struct ncclComm *c = malloc(sizeof(*c));
    if (!c) {
        munmap(s, sizeof(*s));
        return ncclSystemError;
    }
    *c = (struct ncclComm){.shared = s, .rank = rank, .nranks = nranks};
    pthread_barrier_wait(&s->barrier); /* every rank has mapped the file */
    if (rank == 0)
        unlink(id.internal);
    *comm = c;
    return ncclSuccess;
}

NOINLINE ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm)
        return ncclInvalidArgument;
    munmap(comm->shared, sizeof(*comm->shared));
    free(comm);
    return ncclSuccess;
}

NOINLINE ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    if (!comm || !count)
        return ncclInvalidArgument;
    *count = comm->nranks;
    return ncclSuccess;
}

NOINLINE ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    if (!comm || !rank)
        return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}

/* A call on `comm`: inside a group it waits at ncclGroupEnd, else now, for every rank. */
static ncclResult_t synchronise(ncclComm_t comm)
{
    if (!comm)
        return ncclInvalidArgument;
    if (group_depth) {
        group_comm = comm;
        return ncclSuccess;
    }
    pthread_barrier_wait(&comm->shared->barrier);
    return ncclSuccess;
}

NOINLINE ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)op, (void)stream;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                    int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)root, (void)stream;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                 ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)op, (void)root, (void)stream;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                    ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff, (void)recvbuff, (void)sendcount, (void)datatype, (void)stream;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                        ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff, (void)recvbuff, (void)recvcount, (void)datatype, (void)op, (void)stream;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                               ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff, (void)count, (void)datatype, (void)stream;
    if (comm && (peer < 0 || peer >= comm->nranks))
        return ncclInvalidArgument;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                               cudaStream_t stream)
{
    (void)recvbuff, (void)count, (void)datatype, (void)stream;
    if (comm && (peer < 0 || peer >= comm->nranks))
        return ncclInvalidArgument;
    return synchronise(comm);
}

NOINLINE ncclResult_t ncclGroupStart(void)
{
    group_depth++;
    return ncclSuccess;
}

NOINLINE ncclResult_t ncclGroupEnd(void)
{
    if (!group_depth)
        return ncclInvalidUsage;
    if (--group_depth || !group_comm)
        return ncclSuccess;
    ncclComm_t comm = group_comm;
    group_comm = NULL;
    return synchronise(comm);
}

ncclResult_t pncclGetVersion(int *) PROFILING_NAME(ncclGetVersion);
ncclResult_t pncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int) PROFILING_NAME(ncclCommInitRank);
ncclResult_t pncclCommDestroy(ncclComm_t) PROFILING_NAME(ncclCommDestroy);
ncclResult_t pncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)
    PROFILING_NAME(ncclAllReduce);
ncclResult_t pncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)
    PROFILING_NAME(ncclBroadcast);
ncclResult_t pncclReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t)
    PROFILING_NAME(ncclReduce);
ncclResult_t pncclAllGather(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t)
    PROFILING_NAME(ncclAllGather);
ncclResult_t pncclReduceScatter(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)
    PROFILING_NAME(ncclReduceScatter);
ncclResult_t pncclSend(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) PROFILING_NAME(ncclSend);
ncclResult_t pncclRecv(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) PROFILING_NAME(ncclRecv);
ncclResult_t pncclGroupStart(void) PROFILING_NAME(ncclGroupStart);
ncclResult_t pncclGroupEnd(void) PROFILING_NAME(ncclGroupEnd);
