"""The trace file's contract: one long table of rows, each row one `kind` of record.

Every row shares one Arrow schema (``TRACE_SCHEMA``); a kind uses the columns listed for
it in ``KIND_COLUMNS`` and leaves the rest null.  All timestamps are CLOCK_MONOTONIC
nanoseconds (what ``bpf_ktime_get_ns`` returns); other clocks are converted at record
time using the offset stored in the metadata (``clock.wall_minus_mono_ns``).

The file is self-describing: the Parquet key/value metadata key ``trainbpf`` holds a JSON
document (docs/trace-format.md, "Metadata") with the schema version, host, kernel, command line, clock
alignment, topology, probes, thresholds and lost-event counts.  Thread names and
symbolised stacks travel as rows (``thread`` and ``stack`` kinds), so a trace can be
analysed on another machine without the traced process alive.
"""

from __future__ import annotations

from typing import Any, Mapping

import pyarrow as pa

SCHEMA_NAME = "trainbpf.trace"
SCHEMA_VERSION = 2
# Versions this reader reads: a version-1 trace has no Python stack columns (read as null).
READABLE_VERSIONS = (1, 2)
SCHEMA_ID = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
METADATA_KEY = b"trainbpf"

TRACE_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("ts_ns", pa.int64()),  # CLOCK_MONOTONIC start of the event / interval
        ("dur_ns", pa.int64()),  # interval length
        ("tid", pa.int32()),  # kernel pid of the thread
        ("pid", pa.int32()),  # kernel tgid (the process)
        ("cpu", pa.int32()),
        ("comm", pa.string()),
        ("state", pa.string()),
        ("peer_tid", pa.int32()),  # the other thread: waker, parent
        ("peer_pid", pa.int32()),
        ("runq_ns", pa.int64()),  # runnable part of an off-CPU interval
        ("kstack_id", pa.int32()),
        ("ustack_id", pa.int32()),
        ("peer_kstack_id", pa.int32()),
        ("peer_ustack_id", pa.int32()),
        ("addr", pa.uint64()),
        ("op", pa.int32()),
        ("size", pa.int64()),  # bytes
        ("count", pa.int64()),
        ("value", pa.float64()),
        ("name", pa.string()),
        ("node", pa.int32()),  # NUMA node
        # Added in version 2 (older traces read them as null): Python stacks.
        ("pystack_id", pa.int32()),
        ("peer_pystack_id", pa.int32()),
    ]
)

# Columns a version-1 trace lacks; the reader fills them with nulls.
V2_COLUMNS = ("pystack_id", "peer_pystack_id")

# Python stack ids are assigned by the recorder from here up, so they never equal a
# native stack id (bpf_get_stackid's ids are below the stack map's size, < 2**24).
PY_STACK_ID_BASE = 1 << 30

COLUMNS = tuple(TRACE_SCHEMA.names)

# What each kind means and which columns it fills.  Analyzers rely on exactly this.
KIND_COLUMNS: dict[str, tuple[str, ...]] = {
    # A thread seen: at start (name="seed"), created (name="thread"/"process"), exec'd
    # ("exec") or renamed ("rename").  peer_tid = parent/creator.  The newest row per tid
    # carries its current comm.
    "thread": ("ts_ns", "tid", "pid", "comm", "peer_tid", "name"),
    # A thread exited.
    "exit": ("ts_ns", "tid", "pid", "comm"),
    # An off-CPU interval >= min_block_ns: switched out at ts_ns with `state`
    # ("S" sleep, "D" uninterruptible, "R" preempted while runnable, "I", "T", "X", ...),
    # switched back in after dur_ns on `cpu`.  Threads already asleep when the recording
    # started begin at its start; an interval still open at the stop ends there, cpu -1.  runq_ns is the part spent runnable
    # (wake-up -> switch-in; all of dur_ns for "R").  peer_* name the waker and its stacks
    # at the wake-up; peer_tid/peer_pid/peer_pystack_id are null when preempted or when the
    # wake-up ran in interrupt context (a timer, an I/O completion), where peer_kstack_id
    # shows what woke the thread; a waker in task context has no kernel stack (-1: the
    # recorder takes it only from interrupt context).  peer_pystack_id is also null when the
    # wake-up came sooner than min_block_ns after the switch-out (the interval got that long
    # waiting for a CPU).  peer_ustack_id (the waker's native user stack) is not recorded
    # (null); traces before 2026-12-06 have it.
    # kstack_id/ustack_id: stacks at switch-out (-1 where unknown: for intervals seeded at
    # the start, and, on kernels with sched_exit_tp where stacks are taken at switch-in,
    # for intervals still open at the stop).  pystack_id / peer_pystack_id: the thread's
    # and the waker's Python stacks where Python frames were walked (null elsewhere).
    "offcpu": (
        "ts_ns", "dur_ns", "tid", "pid", "cpu", "state", "runq_ns", "peer_tid", "peer_pid",
        "kstack_id", "ustack_id", "peer_kstack_id", "peer_ustack_id", "pystack_id", "peer_pystack_id",
    ),
    # While recording, at each flush of the spool: an off-CPU interval still open then,
    # cut at the flush (ts_ns + dur_ns = that segment's clock), cpu -1.  Only a recording
    # killed before it finished keeps any: those of its last segment become "offcpu" rows
    # (still marked open by cpu -1) when the spool is read or recovered; the rest go.
    "offcpu_open": (
        "ts_ns", "dur_ns", "tid", "pid", "cpu", "state", "runq_ns", "peer_tid", "peer_pid",
        "kstack_id", "ustack_id", "peer_kstack_id", "peer_ustack_id", "pystack_id", "peer_pystack_id",
    ),
    # The end of a spool segment: ts_ns is the clock up to which the segment's rows are
    # complete; a killed recording's duration ends at its last one.  Spool only.
    "segment": ("ts_ns",),
    # Off-CPU intervals below min_block_ns, summed in the kernel per (tid, state) and
    # flushed as deltas: count intervals, dur_ns total off-CPU, runq_ns total runnable.
    # ts_ns is the flush time.
    "offcpu_short": ("ts_ns", "dur_ns", "tid", "pid", "state", "count", "runq_ns"),
    # Preemptions of a traced thread (switched out while runnable), counted in the kernel
    # per (tid, peer_tid) and flushed as deltas: peer_tid = the task that ran instead, in
    # the traced tree or not; peer_pid = its process, read from /proc at the flush (null
    # when it was gone by then); comm = its name at the switch; count = preemptions.
    # ts_ns is the flush time.  Recorders before 2026-12-07 wrote none.
    "preempted_by": ("ts_ns", "tid", "pid", "peer_tid", "peer_pid", "comm", "count"),
    # A CPU-clock sample of a traced thread (rate in metadata thresholds.oncpu_hz).
    "oncpu": ("ts_ns", "tid", "pid", "cpu", "kstack_id", "ustack_id", "pystack_id"),
    # A futex wait >= min_futex_ns: addr = uaddr, op = futex command (op & 0x7f; 256+ for
    # futex_wait / futex_waitv syscalls), ustack_id at entry; pystack_id likewise.
    "futex": ("ts_ns", "dur_ns", "tid", "pid", "addr", "op", "ustack_id", "pystack_id"),
    # What a futex address of a process is, described once while it was alive:
    # state = region (image: a program's or library's data, heap, stack, shared: a
    # MAP_SHARED or /dev/shm mapping, file, anon, unknown), name = the data symbol and
    # offset in an image ("_PyRuntime+0x1b0 [python3.11]"), else the mapping's path.
    "futex_addr": ("ts_ns", "pid", "addr", "state", "name"),
    # Page faults of a thread during [ts_ns, ts_ns + dur_ns): the kernel's per-thread
    # counters (minflt + majflt) read every fault_bucket_ns (tracer/collectors/faults.py).
    "faults": ("ts_ns", "dur_ns", "tid", "pid", "count"),
    # mmap_lock wait start_locking -> acquire_returned; state "read"/"write";
    # count = 1 on success.
    "mmap_lock": ("ts_ns", "dur_ns", "tid", "pid", "state", "count"),
    # Direct or memcg reclaim in a traced thread; state "direct"/"memcg";
    # count = pages reclaimed.
    "reclaim": ("ts_ns", "dur_ns", "tid", "pid", "state", "count"),
    # Memory compaction run by a traced thread; op = status.
    "compaction": ("ts_ns", "dur_ns", "tid", "pid", "op"),
    # mmap/munmap/brk/madvise/mremap calls: name = syscall, addr, size = length,
    # op = flags/advice, count = return value.
    "mm_syscall": ("ts_ns", "dur_ns", "tid", "pid", "name", "addr", "size", "op", "count"),
    # Scheduler NUMA move/swap of a task: op = source node, node = destination node,
    # cpu = destination cpu, name "move"/"swap".
    "numa_move": ("ts_ns", "tid", "pid", "cpu", "op", "node", "name"),
    # Page migrations done in a traced thread: count = pages migrated, size = failed,
    # op = reason.
    "numa_migrate": ("ts_ns", "tid", "pid", "count", "size", "op"),
    # writeback:balance_dirty_pages throttling pause of a writer: dur_ns = pause
    # (the tracepoint's milliseconds), count = dirty pages,
    # size = dirty limit in pages, name = backing device.
    "dirty_pause": ("ts_ns", "dur_ns", "tid", "pid", "count", "size", "name"),
    # A block request issued for a traced thread: dur_ns = issue -> completion,
    # size = bytes, name = rwbs, op = device number, addr = sector.
    "block_rq": ("ts_ns", "dur_ns", "tid", "pid", "size", "name", "op", "addr"),
    # Block requests of every issuer on every device (traced or not, a kernel flusher
    # included), counted in the kernel per (bucket of thresholds.disk_bucket_ns, device,
    # issuing task, direction): ts_ns = the bucket's start, dur_ns = its length,
    # tid/pid/comm = the task that submitted them (block_io_start, in the submitter's
    # context: for buffered writeback the flusher kworker, for fsync the fsync-ing
    # thread), name = the whole disk "MAJ:MIN", state = "read"/"write"/"other" (cache
    # flushes, discards), size = bytes (merged bios included), count = requests (bios
    # on kernels before 6.5).  Under sudo with /proc mounted hidepid, another user's
    # task is unnamed: tid 0, pid null, comm "".  Recorders before 2026-12-07 wrote none.
    "disk_io": ("ts_ns", "dur_ns", "tid", "pid", "comm", "name", "state", "size", "count"),
    # TLB shootdowns of a traced thread, counted in the kernel per (bucket of
    # thresholds.disk_bucket_ns, thread, side) from tlb:tlb_flush: state = "sent" (the
    # thread changed a mapping and sent other CPUs the flush IPI: reason "remote IPI
    # send", in its context) or "received" (the IPI interrupted the thread: reason
    # "remote shootdown", on its CPU), count = flushes, size = bytes named (pages * page
    # size; a full flush names none), cpu = the CPU of the bucket's last one.
    "tlb_flush": ("ts_ns", "dur_ns", "tid", "pid", "cpu", "state", "size", "count"),
    # Bytes written back per inode (writeback:writeback_single_inode: pages written *
    # page size), every inode on the machine, counted in the kernel per (bucket, device,
    # inode, task): tid/pid/comm = the task that wrote it back (a flusher, or a thread in
    # sync; fsync writes its range without this tracepoint: its requests show in
    # disk_io), name = the backing device "MAJ:MIN" (the bdi), addr = the inode number.
    # Buckets, ts_ns, dur_ns and unnamed tasks as in disk_io.
    "writeback_inode": ("ts_ns", "dur_ns", "tid", "pid", "comm", "name", "addr", "size"),
    # Folios dirtied per (bucket, dirtying task, device, inode), every task on the
    # machine (writeback:writeback_dirty_folio, in the dirtier's context): count =
    # folios (a folio is one page or more; the kernel does not say how large).  Columns
    # as in writeback_inode.
    "dirtied": ("ts_ns", "dur_ns", "tid", "pid", "comm", "name", "addr", "count"),
    # A file a traced process had open or mapped, named by (device, inode) while the
    # recording ran: one row per (state, addr) that a traced process's dirtied or
    # write_path rows, or the page_cache rows, needed named, found among the traced processes' open descriptors
    # and mappings: pid = that process, state = the whole disk "MAJ:MIN" (a partition's
    # filesystem names its disk), addr = the inode, name = the path.  An inode no
    # traced process had open or mapped at a scan has no row.
    "file": ("ts_ns", "pid", "state", "addr", "name"),
    # A block device the trace names, once: state = "MAJ:MIN", name = "vda".
    "block_device": ("ts_ns", "state", "name"),
    # CUDA launches (cudaLaunchKernel*, cudaLaunchCooperativeKernel, cudaGraphLaunch,
    # cuLaunchKernel*, cuGraphLaunch and their _ptsz/_ptds/_v2 aliases) counted in the
    # kernel per (tid, bucket of thresholds.cuda_bucket_ns, layer, nesting):
    # ts_ns = the bucket's first launch, dur_ns = from it to the bucket's end, name = layer "runtime" (libcudart) / "driver" (libcuda),
    # op = 1 for driver launches made inside a runtime call (the runtime's own
    # cudaLaunchKernel -> cuLaunchKernel), else 0: the launches issued are the op = 0 rows.
    "cuda_launch": ("ts_ns", "dur_ns", "tid", "pid", "name", "op", "count"),
    # A CUDA wait, copy, allocation or free >= thresholds.min_cuda_ns: name = the call's
    # base name ("cudaStreamSynchronize", "cuMemAlloc"; aliases map to it; layer runtime
    # for cuda*, driver for cu*), state = "wait"/"copy"/"alloc"/"free", op = 1 for a
    # driver call inside a runtime call, addr = the stream argument of waits and copies
    # (the event for event waits), the pointer freed (frees) or allocated (allocations:
    # read at the return; 0 where the call failed to write it); 0 where the call has none,
    # size = bytes for copies and allocations, count = return value (cudaError_t /
    # CUresult, 0 = success), ustack_id = caller's user stack, value = a copy's source
    # pointer (0 for other calls; exact: user addresses lie below 2**47; null in traces
    # recorded before it).  Event calls (cudaEventRecord, cudaEventQuery,
    # cudaStreamWaitEvent and their cu* twins) come whatever their duration, state =
    # "event", addr = the event, runq_ns = the stream it is recorded on or that is made to
    # wait (0 for queries; null before 2026-12-08).
    "cuda_call": ("ts_ns", "dur_ns", "tid", "pid", "name", "state", "op", "addr", "size", "count", "ustack_id",
                  "runq_ns", "value"),
    # Where a CUDA copy's bytes came from (a cuda_call copy row, not nested, with a
    # source pointer; tracer/samplers/pagenodes.py): the node of its source page by a
    # query-only move_pages(2).  ts_ns/tid/pid = the copy's, addr = src, size = bytes,
    # state = "host" (node = the page's node), "not_host" (a device pointer: the kernel
    # answered -EFAULT/-ENOENT) or "unknown" (not asked: rate limit, process gone), node
    # = -1 unless host, name = the memory policy of the mapping holding it (numa_maps:
    # "default", "bind:1", ...; "" unless host).
    "copy_node": ("ts_ns", "tid", "pid", "addr", "size", "node", "state", "name"),
    # A traced thread's CPU affinity and allowed memory nodes when it was first seen
    # (/proc/PID/task/TID/status): state = Cpus_allowed_list, name = Mems_allowed_list.
    "affinity": ("ts_ns", "tid", "pid", "state", "name"),
    # An NCCL call that returned (ncclAllReduce, ncclBroadcast, ncclReduce, ncclAllGather,
    # ncclReduceScatter, ncclSend, ncclRecv, ncclGroupEnd; pnccl* aliases map to them),
    # every one, no threshold: ts_ns = entry, dur_ns = entry -> return, name = the call,
    # op = the thread's own count of these calls before it (0, 1, 2, ... from the first
    # the probe saw; a gap means a lost row), addr = the ncclComm_t argument (0 for
    # ncclGroupEnd), size = the count argument in elements (0 where none), count = the
    # return value (ncclResult_t, 0 = success).
    "collective": ("ts_ns", "dur_ns", "tid", "pid", "name", "op", "addr", "size", "count"),
    # Writes of a traced thread per (bucket of thresholds.disk_bucket_ns, thread, device,
    # inode, path), counted in the kernel (probes/writepath.bpf.c): ts_ns = the bucket's
    # start, dur_ns = its length, name = the whole disk "MAJ:MIN" of the file's file
    # system ("" for io_uring), addr = inode (0 for io_uring), state = path "buffered" /
    # "direct" (O_DIRECT) / "io_uring" / "mapped" (stores into a shared mapping), size =
    # bytes written (0 for io_uring: a request carries no file or length; a page per
    # folio for mapped), count = calls (write syscalls, direct I/Os, io_uring write
    # submissions or folios dirtied by page faults).  A bucket may come in several rows (one per flush): add them up.
    "write_path": ("ts_ns", "dur_ns", "tid", "pid", "name", "addr", "state", "size", "count"),
    # A socket a traced thread received or sent on, described the first time it did
    # (probes/net.bpf.c) and again whenever its peer changed since (a socket connected
    # later): the last row per socket whose ts_ns <= a time names it then.  tid/pid = the
    # thread, addr = the socket's inode (what /proc/PID/fd shows as socket:[N]), state =
    # family "ipv4"/"ipv6"/"unix"/"other", name = the peer: "10.0.0.2:8080",
    # "[fd00::2]:8080", the peer's UNIX path ("@name" in the abstract namespace, "" when
    # unnamed), "" when not connected or for other families; op = protocol (IPPROTO_*:
    # 6 TCP, 17 UDP, 0 for unix), comm = the interface its route goes out of ("veth0",
    # "lo"), else the one it is bound to ("" when not known).  Recorders before
    # 2026-12-08 wrote none of the network kinds.
    "socket": ("ts_ns", "tid", "pid", "addr", "state", "name", "op", "comm"),
    # Bytes and calls of a traced thread per (bucket of thresholds.net_bucket_ns, thread,
    # socket, direction), counted in the kernel from sock:sock_recv_length /
    # sock_send_length (calls that moved bytes; MSG_PEEK receives left out): addr = the
    # socket's inode, state = "recv"/"send", size = bytes, count = calls.  ts_ns = the
    # bucket's start, dur_ns = its length; a bucket may come in several rows (one per
    # flush): add them up.
    "net_io": ("ts_ns", "dur_ns", "tid", "pid", "addr", "state", "size", "count"),
    # Requests a traced thread saw answered per (bucket, thread, socket): count = its
    # receives that were the first after a send on that socket, size = the sum over them
    # of (that receive's return - the last send's return) in ns, value = the largest.
    # Buckets as in net_io.
    "net_request": ("ts_ns", "dur_ns", "tid", "pid", "addr", "count", "size", "value"),
    # TCP retransmits (tcp:tcp_retransmit_skb, from timers and softirqs: no thread) per
    # (bucket, socket) of the sockets a traced thread used: addr = inode, count.
    "retransmit": ("ts_ns", "dur_ns", "addr", "count"),
    # Every interface's packets on the machine per (bucket, interface, direction, task):
    # name = the interface, state = "xmit" (net:net_dev_xmit, sent; tid/pid/comm = the
    # task on the CPU: the sender, or for a packet sent from a softirq, such as an ACK or
    # a retransmit, the task it interrupted; tid 0, pid null, comm "" on an idle CPU) or
    # "recv" (net:netif_receive_skb, in softirq: tid 0, pid null, comm ""), size = bytes,
    # count = packets.  Unnamed tasks as in disk_io.
    "net_device": ("ts_ns", "dur_ns", "tid", "pid", "comm", "name", "state", "size", "count"),
    # The memory cgroup of each traced process, read at the start, every
    # thresholds.cgroup_sample_ns and at the stop (tracer/samplers/memcg.py): one row per
    # (time, cgroup, key); pid = a traced process in it, name = its path below the
    # hierarchy's mount ("/train.slice/job-1"), state = key, count = value: "version"
    # (1 or 2), "max" (v2 memory.max, v1 memory.limit_in_bytes; no row when unlimited),
    # "high" (v2 memory.high; no row when unlimited), "usage" (memory.current,
    # memory.usage_in_bytes) and from memory.stat "file", "anon", "file_dirty",
    # "file_writeback" in bytes and "workingset_refault_file" (a count of refaults); v1's
    # hierarchical total_cache, total_rss, total_dirty, total_writeback,
    # total_workingset_refault_file stand for them.
    "memory_cgroup": ("ts_ns", "pid", "name", "state", "count"),
    # Pages added to and dropped from the page cache, every process's files, counted in
    # the kernel per (bucket of thresholds.disk_bucket_ns, device, inode, change)
    # (probes/pagecache.bpf.c): ts_ns = the bucket's start, dur_ns = its length, name =
    # the whole disk "MAJ:MIN" of the file's file system, addr = inode, state = change
    # "added" (every page added, refaults included) / "dropped" (evicted, truncated,
    # invalidated) / "refaulted" (of the added, those whose (device, inode, index) was
    # dropped earlier in the recording), count = pages.  A bucket may come in several rows
    # (one per flush): add them up.
    "page_cache": ("ts_ns", "dur_ns", "name", "addr", "state", "count"),
    # GPU utilisation sample: ts_ns = the END of the period it describes; op = GPU
    # index, name = uuid, value = utilisation percent, size = memory utilisation percent,
    # count = memory used MiB (null in process rows).  pid null: the whole device
    # (utilization.gpu); pid set: that process's share (NVML smUtil).  dur_ns = the
    # period's length where the source says so (NVML driver samples: since the GPU's
    # previous driver sample; process rows: since the previous query's newest sample),
    # else null (nvidia-smi, NVML rates: the spacing of the samples tells).
    "gpu": ("ts_ns", "dur_ns", "op", "value", "count", "size", "name", "pid"),
    # /proc/vmstat counter delta over dur_ns: name = key, count = delta.
    "vmstat": ("ts_ns", "dur_ns", "name", "count"),
    # Pressure stall information delta: name = "cpu.some", "memory.full", ...;
    # count = stalled microseconds over dur_ns.
    "psi": ("ts_ns", "dur_ns", "name", "count"),
    # Per-thread delay accounting (taskstats): state = "start"/"end", name = field
    # ("cpu_delay", "blkio_delay", "swapin_delay", "freepages_delay", "thrashing_delay",
    # "compact_delay", ...), count = total ns.
    "taskstats": ("ts_ns", "tid", "pid", "state", "name", "count"),
    # The target's numa_maps summed per node: state = "start"/"end", count = pages.
    "numa_maps": ("ts_ns", "pid", "state", "node", "count"),
    # One variable of a traced process's environment that says which rank of a job it is
    # (only the names of tracer/samplers/jobenv.py JOB_VARIABLES are ever read into a trace):
    # name = the variable, state = its value (at most 256 characters; bytes that are not
    # UTF-8 and control characters as \xNN escapes).  Read when the process is seeded or
    # forked and again after an exec; the rows of one read share its ts_ns, and a
    # process has new rows only when its variables changed: its newest ts_ns holds them.
    "process_env": ("ts_ns", "pid", "name", "state"),
    # One field of the container a traced process runs in, from its cgroup path
    # (tracer/samplers/containers.py): name = the field ("id": the runtime's container
    # id; "runtime": docker, containerd, cri-o or podman, where the path says;
    # "pod_uid": the Kubernetes pod's UID, where the path shows it; "cgroup": the path),
    # state = its value.  Read once when the process joins; none for a process in no container.
    "container": ("ts_ns", "pid", "name", "state"),
    # Cumulative lost events for probe `name` (ring buffer full).
    "lost": ("ts_ns", "name", "count"),
    # A symbolised stack: kstack_id = the stack id (kernel and user ids share one map;
    # Python stack ids start at PY_STACK_ID_BASE), state = "kernel"/"user"/"python",
    # pid = process for user and Python stacks, name = frames leaf first, joined by ";"
    # (a Python frame reads "qualname (file:line)").
    "stack": ("ts_ns", "kstack_id", "state", "pid", "name"),
}

KINDS = tuple(KIND_COLUMNS)
# Kinds whose tid/pid may be any task on the machine, traced or not (what filled a disk).
MACHINE_WIDE_KINDS = ("disk_io", "writeback_inode", "dirtied", "net_device")

# What the shared storage columns mean in each kind, by their meaningful names: the one
# name of each field, from the probe's C struct through the collectors (spool.make_batch
# takes rows under them) to the analyzers (Trace.view(kind) reads a kind under them); the
# file keeps the storage names.  Columns not listed keep their storage name.
KIND_NAMES: dict[str, dict[str, str]] = {
    "thread": {"name": "event"},
    "offcpu_short": {"count": "intervals"},
    "preempted_by": {"count": "preemptions"},
    "futex": {"op": "futex_op"},
    "faults": {"count": "faults"},
    "mmap_lock": {"count": "acquired"},
    "reclaim": {"count": "pages_reclaimed"},
    "compaction": {"op": "status"},
    "mm_syscall": {"name": "syscall", "size": "length", "op": "flags", "count": "ret"},
    "numa_move": {"op": "src_node", "node": "dst_node", "name": "move"},
    "numa_migrate": {"count": "pages_migrated", "size": "pages_failed", "op": "reason"},
    "dirty_pause": {"count": "dirty_pages", "size": "limit_pages", "name": "device"},
    "block_rq": {"size": "bytes", "name": "rwbs", "op": "dev", "addr": "sector"},
    "disk_io": {"name": "device", "state": "direction", "size": "bytes", "count": "requests"},
    "tlb_flush": {"state": "side", "size": "bytes", "count": "flushes"},
    "writeback_inode": {"name": "device", "addr": "inode", "size": "bytes"},
    "dirtied": {"name": "device", "addr": "inode", "count": "folios"},
    "file": {"state": "device", "addr": "inode", "name": "path"},
    "block_device": {"state": "device"},
    "cuda_launch": {"name": "layer", "op": "nested", "count": "launches"},
    "cuda_call": {"op": "nested", "size": "bytes", "count": "ret", "runq_ns": "stream", "value": "src"},
    "copy_node": {"addr": "src", "size": "bytes", "state": "source", "name": "policy"},
    "affinity": {"state": "cpus", "name": "mems"},
    "collective": {"op": "seq", "addr": "comm", "size": "elements", "count": "ret"},
    "write_path": {"name": "device", "addr": "inode", "state": "path", "size": "bytes", "count": "calls"},
    "socket": {"addr": "socket", "state": "family", "name": "peer", "op": "protocol", "comm": "interface"},
    "net_io": {"addr": "socket", "state": "direction", "size": "bytes", "count": "calls"},
    "net_request": {"addr": "socket", "count": "requests", "size": "latency_ns", "value": "max_latency_ns"},
    "retransmit": {"addr": "socket", "count": "retransmits"},
    "net_device": {"name": "interface", "state": "direction", "size": "bytes", "count": "packets"},
    "memory_cgroup": {"name": "cgroup", "state": "key", "count": "value"},
    "page_cache": {"name": "device", "addr": "inode", "state": "change", "count": "pages"},
    "gpu": {"op": "index", "name": "uuid", "value": "util_pct", "size": "mem_util_pct", "count": "mem_used_mib"},
    "vmstat": {"name": "key", "count": "delta"},
    "psi": {"name": "resource", "count": "stalled_us"},
    "taskstats": {"name": "field", "count": "total_ns"},
    "numa_maps": {"count": "pages"},
    "process_env": {"name": "variable", "state": "value"},
    "container": {"name": "field", "state": "value"},
    "lost": {"name": "probe", "count": "lost"},
    "stack": {"kstack_id": "stack_id", "state": "space", "name": "frames"},
}


def kernel_device(dev: int) -> str:
    """A kernel dev_t (major << 20 | minor: block_rq's dev, what block tracepoints give)
    as "MAJ:MIN", the way the disk kinds name a device."""
    return f"{int(dev) >> 20}:{int(dev) & ((1 << 20) - 1)}"


def view_columns(kind: str) -> tuple[str, ...]:
    """The columns of `kind` under their meaningful names, in storage order."""
    names = KIND_NAMES.get(kind, {})
    return tuple(names.get(c, c) for c in KIND_COLUMNS[kind])


# Each kind's meaningful names -> their storage columns: KIND_NAMES read the other way.
_STORED: dict[str, dict[str, str]] = {kind: {name: stored for stored, name in names.items()}
                                      for kind, names in KIND_NAMES.items()}


def storage_column(kind: str, column: str) -> str:
    """The storage column that holds `kind`'s meaningful `column`."""
    return _STORED.get(kind, {}).get(column, column)


def stored_columns(kind: str, columns: Mapping[str, Any]) -> dict[str, Any]:
    """`kind`'s columns given under their meaningful names, under their storage names:
    the one place rows are renamed on their way into a trace (Trace.view, named_frame
    rename them back).  A name that is not one of the kind's is a ValueError."""
    names = view_columns(kind)
    unknown = [c for c in columns if c not in names]
    if unknown:
        raise ValueError(f"{kind} rows have no column {unknown[0]} (its columns: {', '.join(names)})")
    return {storage_column(kind, c): values for c, values in columns.items()}


def empty_table() -> pa.Table:
    return TRACE_SCHEMA.empty_table()


def named_frame(kind: str, frame: Any) -> Any:
    """A DataFrame of `kind` rows under the meaningful names: storage names renamed,
    meaningful ones kept, so a reader takes a Trace.frame or a Trace.view alike."""
    names = KIND_NAMES.get(kind, {})
    if not any(c in names for c in frame.columns):
        return frame
    out = frame.copy(deep=False)  # the same column data under new labels
    out.columns = [names.get(c, c) for c in frame.columns]
    return out
