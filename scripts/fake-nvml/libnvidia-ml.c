/* A stand-in for NVML (libnvidia-ml.so.1) on machines without a GPU: the tests load the
 * real pynvml against it.  It simulates the same GPU as scripts/fake-nvidia-smi:
 *
 *  - workloads append busy intervals "start_ns end_ns [pid]\n" (CLOCK_MONOTONIC) to
 *    $TRAINBPF_SIM_GPU (default /tmp/trainbpf-sim-gpu; GPU i > 0 reads "<file>.<i>");
 *    a line without a pid belongs to the first pid listed in "<file>.pids";
 *  - the live pids in "<file>.pids" ("<file>.<i>.pids") are the GPU's compute processes;
 *  - $TRAINBPF_SIM_GPU_COUNT GPUs (1), with the uuids and PCI bus ids nvidia-smi's
 *    stand-in prints, all on NUMA node $FAKE_NVML_NUMA_NODE (unset: not supported).
 *
 * Like the driver, each device keeps utilisation samples on a fixed grid
 * ($TRAINBPF_SIM_NVML_SAMPLE_MS, default 167: 1/6 s), each the busy percent of the period
 * ending at its timestamp (CPU wall-clock microseconds), for the last HISTORY_NS.
 * $TRAINBPF_SIM_NVML_NO_SAMPLES=1 makes nvmlDeviceGetSamples and
 * nvmlDeviceGetProcessUtilization answer NOT_SUPPORTED, as on older GPUs.
 *
 * Only what pynvml (nvidia-ml-py 13) calls for the recorder is here; the signatures and
 * struct layouts are nvml.h's. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nvml.h"

#define MAX_GPUS 16
#define MAX_PIDS 256
#define MIB (1024ULL * 1024ULL)
#define MEMORY_TOTAL_MIB 81559ULL /* what the nvidia-smi stand-in prints */
#define MEMORY_USED_MIB 40536ULL
#define HISTORY_NS 2000000000LL /* the driver's buffer: the last 2 s ... */
#define HISTORY_MAX 120         /* ... and at most this many samples */
#define TAIL_BYTES (16 * 1024)
#define MAX_TAIL_BYTES (4 * 1024 * 1024)
#define NOT_AVAILABLE 0xFFFFFFFFu

static int initialized;
static unsigned int gpu_count = 1;
static long long period_ns = 167000000LL;
static int samples_supported = 1;
/* Like a driver, a sample is stamped with the wall clock when it is first reported, and
 * keeps that stamp across calls (lastSeenTimeStamp compares exactly): a wall-clock step
 * moves only the samples reported after it. */
#define STAMPS 1024
static struct { long long k; unsigned long long wall_us; } stamps[STAMPS];
static struct nvmlDevice_st devices[MAX_GPUS];

struct interval {
    long long start, end;
    unsigned int pid;
};

static long long clock_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* CLOCK_REALTIME minus CLOCK_MONOTONIC, from the tightest of a few brackets: a
 * preemption between the reads would skew it.  The value held changes only when the
 * clock was stepped (by more than STEP_NS), so stamps keep exact spacing otherwise. */
#define STEP_NS 100000LL
static long long offset_held, offset_known;
static long long wall_minus_mono_ns(void) {
    long long best = -1, offset = 0;
    for (int i = 0; i < 5; i++) {
        long long mono = clock_ns(CLOCK_MONOTONIC), wall = clock_ns(CLOCK_REALTIME);
        long long mono2 = clock_ns(CLOCK_MONOTONIC);
        if (best < 0 || mono2 - mono < best) {
            best = mono2 - mono;
            offset = wall - (mono + mono2) / 2;
        }
    }
    if (!offset_known || llabs(offset - offset_held) > STEP_NS) offset_held = offset;
    offset_known = 1;
    return offset_held;
}

/* The wall µs stamp of the sample ending at mono_ns (a grid point, or a process
 * sample's end, which is one too). */
static unsigned long long wall_us(long long mono_ns) {
    long long k = mono_ns / period_ns;
    unsigned int slot = (unsigned long long)k % STAMPS;
    if (stamps[slot].k != k || stamps[slot].wall_us == 0) {
        stamps[slot].k = k;
        stamps[slot].wall_us = (unsigned long long)((mono_ns + wall_minus_mono_ns()) / 1000);
    }
    return stamps[slot].wall_us;
}

static void sim_file(unsigned int index, const char *suffix, char *out, size_t len) {
    const char *base = getenv("TRAINBPF_SIM_GPU");
    if (base == NULL || *base == '\0') base = "/tmp/trainbpf-sim-gpu";
    if (index == 0)
        snprintf(out, len, "%s%s", base, suffix);
    else
        snprintf(out, len, "%s.%u%s", base, index, suffix);
}

/* The pids listed for the GPU, in file order, each once; `live_only` skips exited ones
 * (like nvidia-smi's stand-in, by /proc/PID/comm). */
static int listed_pids(unsigned int index, unsigned int *pids, int max, int live_only) {
    char path[4096];
    sim_file(index, ".pids", path, sizeof path);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    int n = 0;
    char line[64];
    while (n < max && fgets(line, sizeof line, f) != NULL) {
        char *end;
        unsigned long pid = strtoul(line, &end, 10);
        if (end == line || pid == 0) continue;
        int seen = 0;
        for (int i = 0; i < n; i++) seen |= pids[i] == pid;
        if (seen) continue;
        if (live_only) {
            char comm[64];
            snprintf(comm, sizeof comm, "/proc/%lu/comm", pid);
            if (access(comm, R_OK) != 0) continue;
        }
        pids[n++] = (unsigned int)pid;
    }
    fclose(f);
    return n;
}

static int by_start(const void *a, const void *b) {
    const struct interval *x = a, *y = b;
    return (x->start > y->start) - (x->start < y->start);
}

/* Parse complete lines of `data`; the first is skipped when it may be cut. */
static int parse_intervals(char *data, size_t len, int partial_first, unsigned int default_pid,
                           struct interval **out) {
    int n = 0, cap = 256;
    struct interval *iv = malloc(cap * sizeof *iv);
    char *p = data, *stop = data + len;
    if (partial_first) {
        char *nl = memchr(p, '\n', len);
        p = nl ? nl + 1 : stop;
    }
    while (p < stop) {
        char *nl = memchr(p, '\n', stop - p);
        if (nl == NULL) break; /* a line still being written */
        *nl = '\0';
        long long start, end;
        unsigned int pid = default_pid;
        int got = sscanf(p, "%lld %lld %u", &start, &end, &pid);
        if (got >= 2 && end > start) {
            if (n == cap) iv = realloc(iv, (cap *= 2) * sizeof *iv);
            iv[n++] = (struct interval){start, end, got == 3 ? pid : default_pid};
        }
        p = nl + 1;
    }
    *out = iv;
    return n;
}

/* Busy intervals from the end of the GPU's file reaching back to `since_ns`, sorted by
 * start.  Reading only the tail keeps a call cheap however long the workload has run. */
static int read_intervals(unsigned int index, long long since_ns, struct interval **out) {
    char path[4096];
    unsigned int first_pid = 0;
    listed_pids(index, &first_pid, 1, 0);
    sim_file(index, "", path, sizeof path);
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (f == NULL) return 0;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    int n = 0;
    for (long want = TAIL_BYTES;; want *= 4) {
        long offset = size > want ? size - want : 0;
        char *data = malloc(size - offset + 1);
        fseek(f, offset, SEEK_SET);
        size_t got = fread(data, 1, size - offset, f);
        free(*out);
        n = parse_intervals(data, got, offset > 0, first_pid, out);
        free(data);
        long long earliest_end = n ? (*out)[0].end : 0;
        for (int i = 1; i < n; i++) earliest_end = (*out)[i].end < earliest_end ? (*out)[i].end : earliest_end;
        if (offset == 0 || (n && earliest_end <= since_ns) || want >= MAX_TAIL_BYTES) break;
    }
    fclose(f);
    qsort(*out, n, sizeof **out, by_start);
    return n;
}

/* Percent of [t0, t1) covered by the union of the intervals (of `pid` only, unless 0). */
static unsigned int busy_percent(const struct interval *iv, int n, unsigned int pid, long long t0, long long t1) {
    if (t1 <= t0) return 0;
    long long covered = 0, cursor = t0;
    for (int i = 0; i < n; i++) {
        if (pid != 0 && iv[i].pid != pid) continue;
        long long s = iv[i].start > cursor ? iv[i].start : cursor;
        long long e = iv[i].end < t1 ? iv[i].end : t1;
        if (e > s) {
            covered += e - s;
            cursor = e;
        }
    }
    return (unsigned int)llround(100.0 * (double)covered / (double)(t1 - t0));
}

/* The grid samples the device holds now: k_first..k_last, sample k ending at k*period. */
static void history(long long *k_first, long long *k_last) {
    long long now = clock_ns(CLOCK_MONOTONIC);
    long long keep = HISTORY_NS / period_ns;
    if (keep > HISTORY_MAX) keep = HISTORY_MAX;
    if (keep < 1) keep = 1;
    *k_last = now / period_ns;
    *k_first = *k_last - keep + 1;
}

/* First grid sample newer than lastSeenTimeStamp (0: the oldest held). */
static long long first_after(unsigned long long last_seen_us, long long k_first, long long k_last) {
    long long k = k_first;
    while (k <= k_last && last_seen_us != 0 && wall_us(k * period_ns) <= last_seen_us) k++;
    return k;
}

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return fallback;
    char *end;
    long x = strtol(v, &end, 10);
    return *end == '\0' ? (int)x : fallback;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    int count = env_int("TRAINBPF_SIM_GPU_COUNT", 1);
    gpu_count = count < 1 ? 1 : count > MAX_GPUS ? MAX_GPUS : (unsigned int)count;
    int ms = env_int("TRAINBPF_SIM_NVML_SAMPLE_MS", 167);
    period_ns = (ms < 1 ? 167 : ms) * 1000000LL;
    samples_supported = env_int("TRAINBPF_SIM_NVML_NO_SAMPLES", 0) == 0;
    for (unsigned int i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    if (initialized++ == 0) memset(stamps, 0, sizeof(stamps)); /* the period may differ */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (version == NULL || length < 11) return NVML_ERROR_INVALID_ARGUMENT;
    strcpy(version, "580.00.00");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) { return nvmlDeviceGetHandleByIndex_v2(i, d); }

/* The device's index, or -1 for a handle this library did not give out. */
static int device_index(nvmlDevice_t device) {
    if (!initialized || device < devices || device >= devices + gpu_count) return -1;
    return (int)device->index;
}

#define CHECK_DEVICE(device)                                                   \
    int index = device_index(device);                                          \
    if (!initialized) return NVML_ERROR_UNINITIALIZED;                         \
    if (index < 0) return NVML_ERROR_INVALID_ARGUMENT;

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    CHECK_DEVICE(device);
    char text[64];
    int n = snprintf(text, sizeof text, "GPU-5a1c0f2e-7b3d-4c8a-9e61-2d4f8b0c3a%02x", index);
    if (uuid == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < (unsigned int)n + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, text, n + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    CHECK_DEVICE(device);
    if (name == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < sizeof "Fake GPU") return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(name, "Fake GPU");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    CHECK_DEVICE(device);
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->bus = 0x19 + index;
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    CHECK_DEVICE(device);
    int value = env_int("FAKE_NVML_NUMA_NODE", -1);
    if (node == NULL || index < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (value < 0) return NVML_ERROR_NOT_SUPPORTED; /* the caller reads the PCI device's node */
    *node = (unsigned int)value;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    CHECK_DEVICE(device);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = MEMORY_TOTAL_MIB * MIB;
    memory->used = MEMORY_USED_MIB * MIB;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos) {
    CHECK_DEVICE(device);
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int pids[MAX_PIDS];
    int n = listed_pids(index, pids, MAX_PIDS, 1);
    if (infos == NULL && n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *count < (unsigned int)n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++)
        infos[i] = (nvmlProcessInfo_t){pids[i], MEMORY_USED_MIB * MIB, NOT_AVAILABLE, NOT_AVAILABLE};
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}

/* The driver's 1/6 s average: the last completed sample period. */
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    CHECK_DEVICE(device);
    if (utilization == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    long long k_first, k_last;
    history(&k_first, &k_last);
    long long t1 = k_last * period_ns, t0 = t1 - period_ns;
    struct interval *iv;
    int n = read_intervals(index, t0, &iv);
    utilization->gpu = busy_percent(iv, n, 0, t0, t1);
    /* Memory-controller activity follows the kernels, at about half their busy time. */
    utilization->memory = utilization->gpu / 2;
    free(iv);
    return NVML_SUCCESS;
}

/* Samples newer than lastSeenTimeStamp, oldest first.  A NULL buffer asks how many there
 * are; a smaller buffer gets the oldest that fit (the caller reads on from the last
 * timestamp it got), *sampleCount says how many were written. */
nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, int type, unsigned long long lastSeenTimeStamp,
                                  int *sampleValType, unsigned int *sampleCount, nvmlSample_t *samples) {
    CHECK_DEVICE(device);
    if (sampleCount == NULL || sampleValType == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (samples != NULL && *sampleCount == 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!samples_supported) return NVML_ERROR_NOT_SUPPORTED;
    if (type != NVML_GPU_UTILIZATION_SAMPLES && type != NVML_MEMORY_UTILIZATION_SAMPLES)
        return NVML_ERROR_NOT_SUPPORTED;
    long long k_first, k_last;
    history(&k_first, &k_last);
    long long k0 = first_after(lastSeenTimeStamp, k_first, k_last);
    unsigned int available = (unsigned int)(k_last - k0 + 1);
    *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (available == 0) return NVML_ERROR_NOT_FOUND;
    if (samples == NULL) {
        *sampleCount = available;
        return NVML_SUCCESS;
    }
    unsigned int n = *sampleCount < available ? *sampleCount : available;
    struct interval *iv;
    int count = read_intervals(index, k0 * period_ns - period_ns, &iv);
    for (unsigned int i = 0; i < n; i++) {
        long long t1 = (k0 + i) * period_ns;
        unsigned int util = busy_percent(iv, count, 0, t1 - period_ns, t1);
        samples[i].timeStamp = wall_us(t1);
        samples[i].sampleValue.ullVal = 0;
        samples[i].sampleValue.uiVal = type == NVML_GPU_UTILIZATION_SAMPLES ? util : util / 2;
    }
    free(iv);
    *sampleCount = n;
    return NVML_SUCCESS;
}

/* One entry per live compute process: its share of the samples newer than
 * lastSeenTimeStamp (all held ones for 0), stamped with the newest sample's time.  A NULL
 * or too small buffer gets NVML_ERROR_INSUFFICIENT_SIZE and the count needed. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp) {
    CHECK_DEVICE(device);
    if (processSamplesCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!samples_supported) return NVML_ERROR_NOT_SUPPORTED;
    long long k_first, k_last;
    history(&k_first, &k_last);
    long long k0 = first_after(lastSeenTimeStamp, k_first, k_last);
    unsigned int pids[MAX_PIDS];
    int n = listed_pids(index, pids, MAX_PIDS, 1);
    if (k0 > k_last || n == 0) return NVML_ERROR_NOT_FOUND;
    if (utilization == NULL || *processSamplesCount < (unsigned int)n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    long long t0 = (k0 - 1) * period_ns, t1 = k_last * period_ns;
    struct interval *iv;
    int count = read_intervals(index, t0, &iv);
    for (int i = 0; i < n; i++) {
        unsigned int util = busy_percent(iv, count, pids[i], t0, t1);
        utilization[i] = (nvmlProcessUtilizationSample_t){pids[i], wall_us(t1), util, util / 2, 0, 0};
    }
    free(iv);
    *processSamplesCount = n;
    return NVML_SUCCESS;
}
