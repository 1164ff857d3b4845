/* Context-switch storm for bench_throughput.py: pairs of threads hand a token back and
 * forth through futexes as fast as they can, then print the round trips.
 *
 *   pingpong SECONDS [PAIRS] [wait]
 *
 * Pair i is pinned to CPU i % ncpu, so every hand-off is a direct switch between the two
 * threads of a pair (unpinned, each hand-off also crosses CPUs through an idle switch and
 * an IPI, about half the rate).  Each round trip is two voluntary context switches.
 * With "wait" it reads one line from stdin before starting, so a tracer can attach first. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_PAIRS 64

struct pair {
    _Atomic int turn; /* 0: ping's turn, 1: pong's turn */
    int cpu;
    long round_trips;
    pthread_t ping, pong;
};

static struct pair pairs[MAX_PAIRS];
static _Atomic int stop;
static double end_at;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* Waits for `mine`, then hands the turn over; returns 0 once stopped. */
static int hand_off(struct pair *p, int mine)
{
    while (atomic_load(&p->turn) != mine) {
        if (atomic_load(&stop))
            return 0;
        syscall(SYS_futex, &p->turn, FUTEX_WAIT_PRIVATE, !mine, NULL, NULL, 0);
    }
    atomic_store(&p->turn, !mine);
    syscall(SYS_futex, &p->turn, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    return 1;
}

static void *pong(void *arg)
{
    struct pair *p = arg;
    pin(p->cpu);
    while (hand_off(p, 1))
        ;
    return NULL;
}

static void *ping(void *arg)
{
    struct pair *p = arg;
    pin(p->cpu);
    while (!atomic_load(&stop)) {
        for (int i = 0; i < 1000 && hand_off(p, 0); i++)
            p->round_trips++;
        if (now_s() >= end_at)
            atomic_store(&stop, 1);
    }
    /* Release a partner still waiting for its turn. */
    atomic_store(&p->turn, 1);
    syscall(SYS_futex, &p->turn, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SECONDS [PAIRS] [wait]\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    int n = argc > 2 ? atoi(argv[2]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1 || n > MAX_PAIRS)
        return 2;
    if (argc > 3 && strcmp(argv[3], "wait") == 0) {
        char line[16];
        if (!fgets(line, sizeof(line), stdin))
            return 1;
    }
    int ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN);
    double start = now_s();
    end_at = start + seconds;
    for (int i = 0; i < n; i++) {
        pairs[i].cpu = i % ncpu;
        pthread_create(&pairs[i].pong, NULL, pong, &pairs[i]);
        pthread_create(&pairs[i].ping, NULL, ping, &pairs[i]);
    }
    long total = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(pairs[i].ping, NULL);
        pthread_join(pairs[i].pong, NULL);
        total += pairs[i].round_trips;
    }
    double took = now_s() - start;
    printf("round_trips %ld seconds %.3f per_s %.0f\n", total, took, total / took);
    return 0;
}
