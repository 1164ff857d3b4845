"""A large synthetic trace for bench_analyze.py, built with numpy and written the way the
recorder writes (stored_batch -> SpoolWriter -> finalize).

The mix follows what `trainbpf record` produces for a busy trainer: ~50 threads of one
training process (a trainer, dataloader worker processes, a pin-memory thread, a
checkpoint writer, helper threads) over 10 minutes.  Each thread alternates running
and off-CPU stretches that never overlap; off-CPU intervals carry states, run-queue
time, wakers and kernel/user stack ids; futex waits sit inside sleeps; on-CPU samples
fall inside running stretches; faults come per 100 ms bucket, short waits per second
and thread, GPU samples at 10 Hz with idle dips; symbolised stacks and thread rows
travel along.

    python gen_trace.py OUT.parquet [--events 10000000] [--seconds 600] [--threads 50]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa

from trainbpf.trace.schema import SCHEMA_ID
from trainbpf.trace.spool import SpoolWriter, finalize, spool_path_for, stored_batch

START_NS = 1_000_000_000_000
NS = 1_000_000_000
PID = 1000

# Shares of the rows by kind; on-CPU samples, faults, short sums and GPU samples follow
# from rates instead (199 Hz x 2 CPUs, 10 buckets/s, 1 flush/s, 10 Hz).
SHARES = {"offcpu": 0.68, "futex": 0.23, "mm_syscall": 0.09}
FAULT_BUCKETS_USED = 0.44  # share of 100 ms buckets in which a thread has on-CPU samples

KERNEL_STACKS = {
    "S": [("__schedule", "schedule", "futex_do_wait", "__futex_wait", "futex_wait", "do_futex", "__x64_sys_futex", "do_syscall_64"),
          ("__schedule", "schedule", "pipe_read", "vfs_read", "ksys_read", "do_syscall_64"),
          ("__schedule", "schedule", "do_nanosleep", "hrtimer_nanosleep", "__x64_sys_clock_nanosleep", "do_syscall_64"),
          ("__schedule", "schedule", "schedule_hrtimeout_range", "do_epoll_wait", "__x64_sys_epoll_wait", "do_syscall_64")],
    "D": [("__schedule", "schedule", "io_schedule", "folio_wait_bit_common", "filemap_fault", "__do_fault", "handle_mm_fault", "do_user_addr_fault"),
          ("__schedule", "schedule", "schedule_timeout", "io_schedule_timeout", "balance_dirty_pages", "balance_dirty_pages_ratelimited_flags", "generic_perform_write", "vfs_write"),
          ("__schedule", "schedule", "rwsem_down_write_slowpath", "down_write_killable", "__vm_munmap", "__x64_sys_munmap")],
    "R": [("__schedule", "schedule", "irqentry_exit_to_user_mode", "asm_sysvec_apic_timer_interrupt"),
          ("__schedule", "__cond_resched", "clear_huge_page", "do_huge_pmd_anonymous_page", "handle_mm_fault")],
}
USER_FRAMES = ("_PyEval_EvalFrameDefault", "PyObject_Call", "_PyFunction_Vectorcall", "method_vectorcall_O",
               "PyArray_NewFromDescr_int", "npy_alloc_cache", "malloc", "__lll_lock_wait", "pthread_cond_wait",
               "take_gil", "queue_get", "decode_jpeg", "memcpy", "sgemm_kernel", "at::native::copy_")


def thread_table(n: int) -> list[tuple[int, int, str]]:
    """(tid, pid, comm): the trainer, 8 dataloader worker processes, pin-memory,
    checkpoint writer, helper threads."""
    rows = [(PID, PID, "python")]
    rows += [(PID + i, PID + i, "pt_data_worker") for i in range(1, 9)]
    rows += [(PID + 9, PID, "pt_pin_memory"), (PID + 10, PID, "ckpt_writer")]
    rows += [(PID + i, PID, f"pt_autograd_{i % 4}" if i % 3 else "python") for i in range(11, n)]
    return rows[:n]


def stack_rows(rng: np.random.Generator, n_user: int) -> tuple[pa.RecordBatch, dict[str, np.ndarray], np.ndarray]:
    """The stack table; kernel stack ids by state; user stack ids."""
    names, ids, kinds, pids = [], [], [], []
    by_state = {}
    sid = 1
    for state, stacks in KERNEL_STACKS.items():
        by_state[state] = np.arange(sid, sid + len(stacks), dtype=np.int32)
        for frames in stacks:
            names.append(";".join(frames)), ids.append(sid), kinds.append("kernel"), pids.append(0)
            sid += 1
    user_ids = np.arange(sid, sid + n_user, dtype=np.int32)
    for uid in user_ids:
        depth = int(rng.integers(2, 9))
        frames = [USER_FRAMES[j] + " [python3.11]" for j in rng.integers(0, len(USER_FRAMES), depth)]
        names.append(";".join(frames)), ids.append(int(uid)), kinds.append("user"), pids.append(PID)
    batch = stored_batch("stack", {"ts_ns": np.full(len(ids), START_NS, np.int64), "kstack_id": np.array(ids, np.int32),
                                 "state": kinds, "pid": np.array(pids, np.int32), "name": names})
    return batch, by_state, user_ids


def thread_batches(rng, tid: int, pid: int, n_off: int, span: int, tids: np.ndarray, kstacks, ustacks,
                   n_futex: int, n_mm: int, weight: float):
    """One thread's off-CPU intervals, futex waits inside them, on-CPU samples inside its
    running stretches, fault buckets, short-wait sums and mm calls."""
    run = rng.exponential(1.0, n_off)
    off = rng.exponential(1.0, n_off) * rng.choice([0.2, 1.0, 6.0], n_off, p=[0.5, 0.4, 0.1])
    scale = span / (run.sum() + off.sum())
    run_ns = (run * scale).astype(np.int64) + 1_000
    off_ns = (off * scale).astype(np.int64) + 20_000  # streamed intervals are >= min_block_ns
    ends = START_NS + np.cumsum(run_ns + off_ns)
    starts = ends - off_ns
    state = rng.choice(np.array(["S", "R", "D"], dtype=object), n_off, p=[0.75, 0.15, 0.10])
    runq = np.where(state == "R", off_ns, (off_ns * rng.uniform(0, 0.1, n_off)).astype(np.int64))
    wakers = rng.choice(tids, n_off)
    woken = (state == "S") & (wakers != tid)
    kstack = np.empty(n_off, np.int32)
    for s, ids in kstacks.items():
        mask = state == s
        kstack[mask] = rng.choice(ids, int(mask.sum()))
    ustack = rng.choice(ustacks, n_off)
    tid_col, pid_col = np.full(n_off, tid, np.int32), np.full(n_off, pid, np.int32)
    yield stored_batch("offcpu", {
        "ts_ns": starts, "dur_ns": off_ns, "tid": tid_col, "pid": pid_col,
        "cpu": rng.integers(0, 2, n_off).astype(np.int32), "state": state, "runq_ns": runq,
        "peer_tid": pa.array(wakers, mask=~woken), "peer_pid": pa.array(np.where(wakers > PID + 8, PID, wakers), mask=~woken),
        "kstack_id": kstack, "ustack_id": ustack,
        "peer_kstack_id": pa.array(rng.choice(kstacks["S"], n_off), mask=~woken),
        "peer_ustack_id": pa.array(rng.choice(ustacks, n_off), mask=~woken),
    })
    sleeps = np.flatnonzero(state == "S")
    f = np.sort(rng.choice(sleeps, min(n_futex, len(sleeps)), replace=False))
    yield stored_batch("futex", {
        "ts_ns": starts[f] - 2_000, "dur_ns": off_ns[f] + 3_000, "tid": tid_col[: len(f)], "pid": pid_col[: len(f)],
        "addr": rng.choice(np.arange(0x7F0000001000, 0x7F0000001000 + 64 * 200, 64, dtype=np.uint64), len(f)),
        "op": np.full(len(f), 137, np.int32), "ustack_id": ustack[f],
    })
    # On-CPU samples inside running stretches: 199 Hz on each of 2 CPUs, shared out
    # among the threads by weight.
    run_starts = ends - off_ns - run_ns
    n_on = int(199 * 2 * span / NS * weight)
    pick = rng.choice(n_off, n_on, p=run_ns / run_ns.sum())
    on_ts = np.sort(run_starts[pick] + (rng.random(n_on) * run_ns[pick]).astype(np.int64))
    yield stored_batch("oncpu", {
        "ts_ns": on_ts, "tid": np.full(n_on, tid, np.int32), "pid": np.full(n_on, pid, np.int32),
        "cpu": rng.integers(0, 2, n_on).astype(np.int32), "kstack_id": np.full(n_on, -1, np.int32),
        "ustack_id": rng.choice(ustacks, n_on),
    })
    buckets = np.unique((on_ts - START_NS) // 100_000_000)  # faults where the thread ran
    yield stored_batch("faults", {
        "ts_ns": START_NS + buckets * 100_000_000, "dur_ns": np.full(len(buckets), 100_000_000, np.int64),
        "tid": np.full(len(buckets), tid, np.int32), "pid": np.full(len(buckets), pid, np.int32),
        "count": rng.integers(1, 5_000, len(buckets)),
    })
    seconds = span // NS
    for s in ("S", "R"):
        n = int(seconds)
        counts = rng.integers(10, 2_000, n)
        yield stored_batch("offcpu_short", {
            "ts_ns": START_NS + np.arange(1, n + 1) * NS, "dur_ns": counts * rng.integers(2_000, 15_000, n),
            "tid": np.full(n, tid, np.int32), "pid": np.full(n, pid, np.int32), "state": np.full(n, s, dtype=object),
            "count": counts, "runq_ns": counts * 1_000,
        })
    mm = np.sort(rng.choice(n_off, n_mm))
    calls = np.array(["mmap", "munmap", "madvise", "brk"], dtype=object)
    yield stored_batch("mm_syscall", {
        "ts_ns": run_starts[mm], "dur_ns": rng.integers(1_000, 200_000, n_mm), "tid": np.full(n_mm, tid, np.int32),
        "pid": np.full(n_mm, pid, np.int32), "name": rng.choice(calls, n_mm, p=[0.4, 0.4, 0.15, 0.05]),
        "addr": np.full(n_mm, 0x7F0000000000, np.uint64), "size": rng.choice([1 << 16, 1 << 20, 3 << 20, 1 << 26], n_mm),
        "op": np.zeros(n_mm, np.int32), "count": np.zeros(n_mm, np.int64),
    })


def generate(path: Path, *, events: int = 10_000_000, seconds: float = 600.0, threads: int = 50, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    span = int(seconds * NS)
    table = thread_table(threads)
    tids = np.array([t for t, _, _ in table], dtype=np.int32)
    meta = {
        "schema": SCHEMA_ID, "host": "bench-synthetic", "kernel": "6.18.0-synthetic",
        "argv": ["trainbpf", "record", "--pid", str(PID)], "target_pid": PID, "target_cmdline": ["python", "train.py"],
        "trainer_tid": None,
        "clock": {"start_mono_ns": START_NS, "end_mono_ns": START_NS + span, "wall_minus_mono_ns": 0, "source": "CLOCK_MONOTONIC"},
        "topology": {"nodes": {"0": [0, 1]}, "gpus": [{"index": 0, "bus_id": "00000000:19:00.0", "node": 0}], "gpu_node": 0, "declared": False},
        "probes": ["sched", "futex", "faults", "oncpu", "mm", "writeback", "block"],
        "thresholds": {"min_block_ns": 20_000, "min_futex_ns": 20_000, "min_lock_ns": 10_000, "oncpu_hz": 199,
                       "fault_bucket_ns": 100_000_000, "ringbuf_pages": 512, "hz": 250},
        "gpu": {"source": "nvidia-smi", "samples": int(seconds * 10)}, "lost": {}, "complete": True,
        "stop_reason": "target exited", "system_wide": False,
    }
    writer = SpoolWriter(Path(path), meta)
    stacks, kstacks, ustacks = stack_rows(rng, 8_000)
    writer.add(stacks)
    writer.add(stored_batch("thread", {
        "ts_ns": np.full(len(table), START_NS, np.int64), "tid": tids, "pid": np.array([p for _, p, _ in table], np.int32),
        "comm": [c for _, _, c in table], "name": ["seed"] * len(table)}))
    # Rows by thread: the trainer and the workers are the busiest.
    weight = np.where(tids == PID, 4.0, np.where(tids <= PID + 10, 2.0, 0.6))
    weight /= weight.sum()
    # Rows that come at fixed rates (on-CPU samples, fault buckets where threads ran,
    # short sums, GPU samples, stacks) leave the rest to the shared-out kinds.
    fixed = seconds * (2 * 199 + threads * (2 + 10 * FAULT_BUCKETS_USED) + 10) + 8_000 + threads
    events = max(0, int(events - fixed) / sum(SHARES.values()))
    for (tid, pid, _), w in zip(table, weight):
        n_off = int(events * SHARES["offcpu"] * w)
        for batch in thread_batches(rng, tid, pid, n_off, span, tids, kstacks, ustacks,
                                    int(events * SHARES["futex"] * w), int(events * SHARES["mm_syscall"] * w), w):
            writer.add(batch)
        writer.flush()
    n_gpu = int(seconds * 10)
    ts = np.arange(1, n_gpu + 1) * 100_000_000
    util = np.where((ts % (2 * NS)) < 300_000_000, 4.0, 93.0) + rng.normal(0, 1.5, n_gpu)
    writer.add(stored_batch("gpu", {
        "ts_ns": START_NS + ts, "op": np.zeros(n_gpu, np.int32), "value": util.clip(0, 100),
        "count": np.full(n_gpu, 40_536, np.int64), "size": np.full(n_gpu, 45, np.int64),
        "name": np.full(n_gpu, "GPU-00000000-0000-0000-0000-000000000000", dtype=object)}))
    writer.flush()
    writer.close()
    return finalize(spool_path_for(Path(path)), Path(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=50)
    args = ap.parse_args()
    generate(args.output, events=args.events, seconds=args.seconds, threads=args.threads)


if __name__ == "__main__":
    main()
