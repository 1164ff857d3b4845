/* A stand-in for the CUDA runtime (libcudart.so.12) over the stand-in driver
 * (libcuda.c): each call goes through the driver call the real runtime would make
 * (cudaLaunchKernel -> cuLaunchKernel, cudaStreamSynchronize -> cuStreamSynchronize,
 * cudaMalloc -> cuMemAlloc_v2, ...), so the probe sees runtime and driver calls nested.
 * Signatures are cuda_runtime_api.h's; the _ptsz/_ptds aliases are distinct functions. */
#include <stddef.h>
#include <stdint.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void *cudaGraphExec_t;
typedef struct { unsigned x, y, z; } dim3;
typedef uint64_t CUdeviceptr;

#define NOINLINE __attribute__((noinline, used))

extern int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                          void **, void **);
extern int cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               void *, void **, void **);
extern int cuGraphLaunch(void *, void *);
extern int cuStreamSynchronize(void *);
extern int cuStreamSynchronize_ptsz(void *);
extern int cuCtxSynchronize(void);
extern int cuEventSynchronize(void *);
extern int cuMemcpy(CUdeviceptr, CUdeviceptr, size_t);
extern int cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, void *);
extern int cuMemcpyAsync_ptsz(CUdeviceptr, CUdeviceptr, size_t, void *);
extern int cuMemAlloc_v2(CUdeviceptr *, size_t);
extern int cuMemFree_v2(CUdeviceptr);
extern int cuMemHostAlloc(void **, size_t, unsigned int);
extern int cuMemFreeHost(void *);
extern int cuEventRecord(void *, void *);
extern int cuEventQuery(void *);
extern int cuStreamWaitEvent(void *, void *, unsigned int);

NOINLINE cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return 0; }

NOINLINE cudaError_t cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s)
{
    return cuLaunchKernel((void *)f, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)shmem, s, args, NULL);
}

NOINLINE cudaError_t cudaLaunchKernel_ptsz(const void *f, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s)
{
    return cuLaunchKernel_ptsz((void *)f, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)shmem, s, args, NULL);
}

NOINLINE cudaError_t cudaGraphLaunch(cudaGraphExec_t g, cudaStream_t s) { return cuGraphLaunch(g, s); }
NOINLINE cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cuStreamSynchronize(s); }
NOINLINE cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) { return cuStreamSynchronize_ptsz(s); }
NOINLINE cudaError_t cudaDeviceSynchronize(void) { return cuCtxSynchronize(); }
NOINLINE cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cuEventSynchronize(e); }

NOINLINE cudaError_t cudaMemcpy(void *d, const void *s, size_t n, int kind)
{
    (void)kind;
    return cuMemcpy((CUdeviceptr)d, (CUdeviceptr)s, n);
}

NOINLINE cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, cudaStream_t st)
{
    (void)kind;
    return cuMemcpyAsync((CUdeviceptr)d, (CUdeviceptr)s, n, st);
}

NOINLINE cudaError_t cudaMemcpyAsync_ptsz(void *d, const void *s, size_t n, int kind, cudaStream_t st)
{
    (void)kind;
    return cuMemcpyAsync_ptsz((CUdeviceptr)d, (CUdeviceptr)s, n, st);
}

NOINLINE cudaError_t cudaMalloc(void **p, size_t n) { return cuMemAlloc_v2((CUdeviceptr *)p, n); }
NOINLINE cudaError_t cudaFree(void *p) { return cuMemFree_v2((CUdeviceptr)p); }
NOINLINE cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int flags) { return cuMemHostAlloc(p, n, flags); }
NOINLINE cudaError_t cudaMallocHost(void **p, size_t n) { return cuMemHostAlloc(p, n, 0); }
NOINLINE cudaError_t cudaFreeHost(void *p) { return cuMemFreeHost(p); }
NOINLINE cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t st)
{
    (void)st;
    return cuMemAlloc_v2((CUdeviceptr *)p, n);
}
NOINLINE cudaError_t cudaFreeAsync(void *p, cudaStream_t st)
{
    (void)st;
    return cuMemFree_v2((CUdeviceptr)p);
}
NOINLINE cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t st) { return cuEventRecord(e, st); }
NOINLINE cudaError_t cudaEventQuery(cudaEvent_t e) { return cuEventQuery(e); }
NOINLINE cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t e, unsigned int flags)
{
    return cuStreamWaitEvent(st, e, flags);
}
