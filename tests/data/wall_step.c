/* LD_PRELOAD shim for tests: CLOCK_REALTIME jumps by $TRAINBPF_TEST_WALL_STEP_NS once
 * $TRAINBPF_TEST_WALL_STEP_AFTER_NS of CLOCK_MONOTONIC have passed since the process first
 * read it, as when NTP or a VM's time agent steps the wall clock during a recording. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static long long env_ll(const char *name) {
    const char *v = getenv(name);
    return v ? atoll(v) : 0;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    static long long first_mono;
    if (real == NULL) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc != 0 || id != CLOCK_REALTIME) return rc;
    struct timespec m;
    real(CLOCK_MONOTONIC, &m);
    long long mono = m.tv_sec * 1000000000LL + m.tv_nsec;
    if (first_mono == 0) first_mono = mono;
    if (mono - first_mono >= env_ll("TRAINBPF_TEST_WALL_STEP_AFTER_NS")) {
        long long wall = ts->tv_sec * 1000000000LL + ts->tv_nsec + env_ll("TRAINBPF_TEST_WALL_STEP_NS");
        ts->tv_sec = wall / 1000000000LL;
        ts->tv_nsec = wall % 1000000000LL;
    }
    return rc;
}
