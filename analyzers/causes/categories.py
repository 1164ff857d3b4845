"""The finding categories: one record per category, in the order the design lists them
(docs/design.md §Attribution model; docs/findings.md, "The categories").

A record says everything that is particular to its category: which of the trainer's
states, on-CPU stall classes and futex classes stand for it; the evidence it quotes (a
builder in analyzers/causes/evidence.py, returning numbers); whether it can be critical; the
node checks of `trainbpf health` that point at it; and, for the report layer, its summary
template, recommendation and colour.  The analyzers compute with the names and the
evidence; only the report layer (trainbpf/reports/document.py, reports/html.py) writes the
sentences.  Every other table of categories is derived from these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import pandas as pd

from trainbpf.analyzers.causes import evidence as ev, host
from trainbpf.analyzers.causes.network import network_culprits
from trainbpf.analyzers.vocab import HOST_CLASSES, RUN_CLASSES, STATES


@dataclass(frozen=True)
class Category:
    """One finding category.  `summary` is formatted with `who` (the threads, named) and
    `s` (its starved seconds); `unmeasured` (numa_remote only) is the summary of a
    finding seen without starved time, formatted with `who` and `gpu_node`; `own_work`
    (input_pipeline only) the summary of one that is mostly the trainer's own host work
    of this category, formatted with `who`, `s`, `where` (its function) and `workers`.
    `cases`: what the evidence found for certain, by name -> (summary, recommendation):
    a finding whose evidence says `case` takes that pair instead of the general one,
    formatted with `who`, `s` and the evidence's `names` (strings: the culprit's names)."""

    name: str
    evidence: ev.Builder
    summary: str
    recommendation: str
    colour: str
    states: tuple[str, ...] = ()  # the trainer's own blocked states that mean it when not followed
    run_class: str | None = None  # the on-CPU stall class (analyzers/causes/stack_reading.py) that means it
    futex_class: str | None = None  # futex waits of this class mean it (never followed to a waker)
    critical: bool = True  # can be critical
    # The share of the analysed window it must explain to be critical (default: findings.CRITICAL_MIN_IMPACT).
    critical_min_impact: float | None = None
    host_class: str | None = None  # the trainer's host-bound running time of this class (vocab.HOST_CLASSES) means it
    health_checks: tuple[str, ...] = ()  # `trainbpf health` node checks that point at it
    unmeasured: str | None = None
    own_work: str | None = None
    cases: Mapping[str, tuple[str, str]] = field(default_factory=dict)


# Another writer's page cache fills the disk: the advice is about that writer, not the storage.
_WRITEBACK_ADVICE = (
    "The disk is busy with the writeback of {file}, which {writer_name} writes {through}: change that "
    "writer, not the storage. Write it with O_DIRECT or io_uring, rate-limit it (io.max or io.weight on its cgroup, "
    "ionice), flush it in small steps (sync_file_range) instead of letting writeback come in bursts, or put it on "
    "another device or in object storage.")

# Fresh memory faulted in 4 KiB pages (analyzers/causes/huge_pages.py): about 256 faults a
# MiB where 2 MiB pages take 0.5.
_SMALL_PAGES_ADVICE = (
    "{first} let the kernel back big buffers with 2 MiB pages: madvise(MADV_HUGEPAGE) on them (THP is "
    "{{thp_mode}}; 'always' in /sys/kernel/mm/transparent_hugepage/enabled does it for every mapping), or "
    "map them from hugetlbfs (MAP_HUGETLB); align them to 2 MiB. That is about 512 times fewer faults "
    "and TLB misses.")

REGISTRY: tuple[Category, ...] = (
    Category(
        "input_pipeline", host.input_pipeline, "The trainer waited {s:.2f} s for data that {who} was still producing",
        "The trainer waits for data that is still being produced: add data-loader workers (num_workers > 0, "
        "persistent_workers=True) so batches are decoded off the trainer's thread, make decoding cheaper or move it "
        "off the critical path (pre-decode, cache decoded samples), and prefetch more batches (prefetch_factor, "
        "pin_memory).",
        "#1f77b4", run_class="user", host_class="loading",
        own_work="{who} decoded its own batches for {s:.2f} s ({where}): {workers}"),
    Category(
        "cpu_contention", ev.cpu_contention, "{who} waited {s:.2f} s runnable for a CPU while the GPU starved",
        "Threads are runnable but get no CPU: run fewer threads (torch.set_num_threads, OMP_NUM_THREADS, fewer "
        "workers), isolate cores for the trainer, and pin threads (taskset, sched_setaffinity) so data workers do "
        "not preempt it.",
        "#f29d38", states=("runnable",), health_checks=("runqueue_latency_p99_seconds", "cpu_pressure_ratio")),
    Category(
        "lock_contention", ev.futex_class_waits("lock"), "{who} waited {s:.2f} s on a contended lock",
        "Threads queue on a shared lock: reduce sharing (per-thread queues and buffers); if the lock is the "
        "allocator's (malloc/arena frames in the stack) use a thread-caching allocator (tcmalloc or jemalloc via "
        "LD_PRELOAD) or tune MALLOC_ARENA_MAX; or run fewer threads.",
        "#8e6bd1", futex_class="lock", cases={
            "malloc_arena": (
                "{who} waited {s:.2f} s for glibc's malloc arena lock ({lock}), held by {holders}",
                "Every malloc and free queues on one glibc arena lock ({lock}): "
                "preload a thread-caching allocator (LD_PRELOAD=libjemalloc.so.2 or libtcmalloc_minimal.so.4), "
                "or give the threads arenas and caches of their own (unset MALLOC_ARENA_MAX or raise it to the "
                "number of allocating threads, the same for GLIBC_TUNABLES=glibc.malloc.arena_max, and keep "
                "glibc.malloc.tcache_count above 0); and allocate less in those threads (reuse buffers)."),
            "python_lock": (
                "{who} waited {s:.2f} s for a {lock}, held by {holders}",
                "Threads queue on one Python lock ({lock}; held by {holders}): hold it for less time (do the work "
                "outside the `with lock:` block), split it per thread or per queue, or hand data over through a "
                "queue instead of shared state."),
        }),
    Category(
        "gil_contention", ev.futex_class_waits("gil"), "{who} waited {s:.2f} s for the Python GIL",
        "Python threads fight for the GIL: move CPU-heavy work to processes (DataLoader workers) or to code that "
        "releases the GIL (numpy, torch ops), and cut the number of Python threads.",
        "#6a3d9a", futex_class="gil"),
    Category(
        "allocator_churn", ev.allocator_churn,
        "{who} lost {s:.2f} s to faults on freshly mapped memory amid mmap/munmap churn",
        "Memory is mapped and unmapped over and over, and every fresh page faults: pool and reuse buffers "
        "(size-class pools, caching allocators), raise the mmap threshold (MALLOC_MMAP_THRESHOLD_/"
        "MALLOC_TRIM_THRESHOLD_, or tcmalloc/jemalloc), and use huge pages.",
        "#b15928", run_class="allocator_churn", cases={"small_pages": (
            "{who} lost {s:.2f} s to faults on freshly mapped memory amid mmap/munmap churn, in 4 KiB pages: "
            "{faults_per_mib} faults a MiB over {mapped} mapped (THP {thp_mode}); huge pages would take "
            "{faults_with_huge_pages} faults instead of {faults}",
            _SMALL_PAGES_ADVICE.format(first="Pool and reuse buffers (size-class pools, caching allocators) so "
                                             "memory is not mapped afresh every step, and")),
            "freed_late": (
                "{who} lost {s:.2f} s to faults on fresh {size_class} buffers: each lives {lifetime} "
                "({alive} alive at once), a fresh one is mapped every time and none is reused, so every {per_unit} "
                "pays {faults} faults; mapped by {mapper}, unmapped by {unmapper}{held_back}",
                "{size_class} buffers are held {lifetime} and then unmapped, while a fresh one is mapped and faulted "
                "in each time: release each at the step boundary after an explicit stream sync (or event "
                "synchronize) instead of holding it, and keep a pool of {alive} buffers (the pipeline's depth) that "
                "are reused rather than mapped afresh; that saves {faults} faults {per}."),
        }),
    Category(
        "page_faults", ev.page_faults, "{who} lost {s:.2f} s in the page-fault path",
        "Time goes to page faults: pre-fault or pin buffers once (MAP_POPULATE, mlock, touching them at start), "
        "reuse pooled memory, and use huge pages (fewer faults and TLB misses).",
        "#d64545", states=("page_faults",), run_class="page_faults", cases={"small_pages": (
            "{who} lost {s:.2f} s in the page-fault path, in 4 KiB pages: {faults_per_mib} faults a MiB over "
            "{mapped} mapped (THP {thp_mode}); huge pages would take {faults_with_huge_pages} faults instead of "
            "{faults}",
            _SMALL_PAGES_ADVICE.format(first="Pre-fault or pin buffers once (MAP_POPULATE, mlock, touching them at "
                                             "start), reuse pooled memory, and"))}),
    Category(
        "mmap_lock", ev.mmap_lock, "{who} waited {s:.2f} s for the mmap_lock",
        "Threads wait for the process's mmap_lock: make fewer mmap/munmap/mprotect calls while other threads "
        "fault (pool buffers, allocate up front, batch unmaps).",
        "#a0522d", states=("mmap_lock",), run_class="mmap_lock"),
    Category(
        "memory_reclaim", ev.memory_reclaim, "{who} lost {s:.2f} s to direct memory reclaim and compaction",
        "Allocations wait for the kernel to reclaim or compact memory: raise or remove the memory limit (cgroup "
        "memory.max/memory.high), reduce page-cache pressure (drop caches, O_DIRECT for big reads) and "
        "pre-allocate memory before training.",
        "#c2389a", states=("memory_reclaim",), run_class="memory_reclaim",
        health_checks=("reclaim_ratio", "memory_pressure_ratio"),
        cases={
            "page_cache": (
                "{who} lost {s:.2f} s to reclaim in cgroup {cgroup} (memory limit {limit}), {file_share:.0%} of it "
                "page cache, most of it {file}{by}{dirty}",
                "Reclaim in {cgroup} makes room in its page cache, most of it {file}: the trainer's own memory is not "
                "the problem. Drop those pages once they are written or read (sync_file_range then posix_fadvise "
                "POSIX_FADV_DONTNEED, or O_DIRECT for checkpoints and one-pass reads), put {file_user} in a cgroup of "
                "its own, or raise the limit if the cache is wanted."),
            "anon": (
                "{who} lost {s:.2f} s to reclaim in cgroup {cgroup} (memory limit {limit}), mostly anonymous memory "
                "({anon}) of its processes",
                "The processes in {cgroup} need more memory than its limit ({limit}): raise memory.max (or "
                "memory.limit_in_bytes), or use less (smaller batches or prefetch queues, fewer workers, shared "
                "instead of copied datasets)."),
        }),
    Category(
        "dirty_throttling", ev.dirty_throttling,
        "{who} was throttled {s:.2f} s writing dirty pages (balance_dirty_pages)",
        "Writers are throttled for dirty pages (balance_dirty_pages): write checkpoints with O_DIRECT or "
        "io_uring, lower or tune vm.dirty_bytes/dirty_background_bytes, put the writer in its own cgroup/io "
        "class, or stream checkpoints to object storage.",
        "#e8702a", states=("dirty_throttling",), run_class="dirty_throttling", health_checks=("dirty_throttle_ratio",),
        cases={"writeback": (
            "{who} was throttled {s:.2f} s writing dirty pages on {device}: {writer} dirtied {written} of "
            "{file}{via} meanwhile", _WRITEBACK_ADVICE)}),
    Category(
        "block_io", ev.block_io, "{who} waited {s:.2f} s for block I/O",
        "Threads wait for block I/O: use faster storage or a local cache, prefetch and read ahead, and warm the "
        "page cache before training.",
        "#2f6db5", states=("block_io",), run_class="block_io", health_checks=("io_pressure_ratio",),
        cases={
            "writeback": (
                "{who} waited {s:.2f} s for I/O on {device} behind {written} of writeback of {file}, "
                "dirtied by {writer}{via}{again}", _WRITEBACK_ADVICE),
            "direct_writes": (
                "{who} waited {s:.2f} s for I/O on {device} behind {issued} of O_DIRECT writes to {file} by {issuer}"
                "{again}",
                "{issuer_name} already writes {file} with O_DIRECT, so the device's bandwidth is the limit: rate-limit "
                "that writer (io.max or io.weight on its cgroup, ionice), write while the loader is idle, or move it to "
                "another device or to object storage."),
            "refault": (
                "{who} waited {s:.2f} s for I/O on {device}: it re-read {refaulted} of {file} after the page cache "
                "dropped it for {evictor}",
                "The data is read again because the page cache dropped it for {evictor}: keep that writer's pages out "
                "of the cache (O_DIRECT, or posix_fadvise POSIX_FADV_DONTNEED after writing), give {evictor_name} a "
                "cgroup of its own, or keep the dataset resident (a larger memory limit, a local copy, mlock)."),
            "other_io": (
                "{who} waited {s:.2f} s for I/O on {device} behind {issued} of I/O by {issuer}{again}",
                "{issuer_name} keeps {device} busy while the training data waits on it: limit it (io.max or io.weight "
                "on its cgroup, ionice -c3), run it elsewhere, or give the dataset its own device."),
        }),
    Category(
        "network_io", network_culprits, "{who} waited {s:.2f} s on the network",
        "Threads wait for data from the network: keep more requests in flight (prefetch more batches, more loader "
        "workers or concurrent fetches), cache what is read again (a local copy, a cache in front of the store), and "
        "check the path to the peer (its latency per request, retransmits, the interface's load).",
        "#0f8b8d", states=("network_io",), cases={
            "upload": (
                "{who} waited {s:.2f} s on the network for {peer} while {uploader} sent {uploaded} on {interface} "
                "({rate}/s during the waits)",
                "{uploader_name} sends {uploaded} on {interface} while the data from {peer} waits behind it: cap the "
                "upload's concurrency and rate (fewer multipart parts in flight, a bandwidth limit on the uploader or "
                "its cgroup), move it off the critical path (another interface or node), or schedule it between "
                "steps."),
            "slow_peer": (
                "{who} waited {s:.2f} s on the network for {peer}: {requests} requests, {latency_ms:.1f} ms each on "
                "average",
                "{peer} takes {latency_ms:.1f} ms per request (at most {max_latency_ms:.1f} ms): keep more requests in "
                "flight (prefetch more batches, more loader workers or concurrent fetches), cache what is fetched "
                "again (a local copy or a cache in front of {peer}), or make that server answer faster."),
        }),
    Category(
        "numa_remote", ev.numa_remote, "{who} produced data on a NUMA node other than the GPU's, costing {s:.2f} s",
        "Data-loading threads run on a NUMA node other than the GPU's: bind them and their memory to the GPU's "
        "node (numactl --cpunodebind/--membind, sched_setaffinity in worker_init_fn).",
        "#17becf", health_checks=("numa_remote_ratio",),
        unmeasured="{who} ran mostly on a NUMA node other than the GPU's (node {gpu_node}), "
        "without measurable starved time",
        cases={"remote_copies": (
            "{remote_pct} of the {copied} copied to GPU {gpu} (node {gpu_node}) came from {source_nodes} pages; "
            "{copiers}",
            "The bytes copied to the GPU sit on a NUMA node other than the GPU's: run the loader threads on the "
            "GPU's node (sched_setaffinity in worker_init_fn, or numactl --cpunodebind={gpu_node} "
            "--membind={gpu_node}) and allocate the pinned buffers there.")}),
    Category(
        "host_compute", host.host_compute,
        "{who} was busy on the CPU for {s:.2f} s while the GPU idled ({where})",
        "The GPU waits for the trainer's own CPU work between launches (an optimizer step on the CPU, Python "
        "overhead, logging or metrics): move that work to the GPU or vectorise it (a fused or foreach optimizer, "
        "torch.compile or graph capture for launch overhead), do it less often or asynchronously (log every N steps), "
        "and overlap it with GPU work.",
        "#bcbd22", host_class="compute", critical_min_impact=0.1),
    Category(
        "collective", ev.collective,
        "{who} waited {s:.2f} s inside collectives for no traced rank's lateness (the collective's own "
        "communication, or ranks this trace does not hold)",
        "The collectives themselves take this time (or ranks this trace does not hold were late): record the "
        "launcher's pid to trace every rank; overlap communication with computation (DDP gradient bucketing, "
        "no_sync with gradient accumulation), make fewer and larger collectives, and check the interconnect "
        "(NCCL_DEBUG=INFO, nccl-tests) before changing the training code.",
        # Data-parallel training spends some time in its all-reduces by design.
        "#7f7f7f", critical_min_impact=0.1),
    Category(
        "other", ev.unexplained, "{s:.2f} s of starved time has no cause the trace can name",
        "Time the trace cannot attribute (timer sleeps, short waits, untraced wakers): record with more probes "
        "(futex, faults, mm, writeback, block) or a lower --min-block-us to see more.",
        "#4d4d4d", states=("futex", "sleep", "uninterruptible", "short_wait", "other"), critical=False),
)

BY_NAME: dict[str, Category] = {c.name: c for c in REGISTRY}
CATEGORIES: tuple[str, ...] = tuple(BY_NAME)
CATEGORY_DTYPE = pd.CategoricalDtype(CATEGORIES)
CATEGORY_CODE: dict[str, int] = {name: i for i, name in enumerate(CATEGORIES)}

# What the trainer's own blocked state means when it is not followed to a waker.
STATE_CATEGORY: dict[str, str] = {state: c.name for c in REGISTRY for state in c.states}
# Running stall classes, as categories.
RUN_CATEGORY: dict[str, str] = {c.run_class: c.name for c in REGISTRY if c.run_class}
# Futex classes that are a category of their own (handoffs: never followed to a waker).
FUTEX_CATEGORY: dict[str, str] = {c.futex_class: c.name for c in REGISTRY if c.futex_class}
# The trainer's host work classes, as categories.
HOST_CATEGORY: dict[str, str] = {c.host_class: c.name for c in REGISTRY if c.host_class}
# The category a failing `trainbpf health` node check points at.
CHECK_CATEGORY: dict[str, str] = {check: c.name for c in REGISTRY for check in c.health_checks}

if (set(STATE_CATEGORY) != set(STATES) - {"running"} or set(RUN_CATEGORY) != set(RUN_CLASSES)
        or set(HOST_CATEGORY) != set(HOST_CLASSES)):
    raise RuntimeError("analyzers/causes/categories.py: every blocked state, run class and host class needs a category")
