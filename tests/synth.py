"""Build small synthetic traces as real trace files (stored_batch + SpoolWriter + finalize).

Times are seconds from the trace start; durations are seconds.  A test describes what
each thread did, writes the file and analyses it like a recorded one:

    s = Synth(duration_s=10)
    s.thread(100, "python")
    s.thread(200, "pt_data_worker", pid=200)
    s.offcpu(100, 1.0, 0.1, waker=200)
    s.gpu_from_running(100)
    trace = s.read(tmp_path)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa

from trainbpf.trace.reader import read_trace
from trainbpf.trace.schema import KIND_COLUMNS, PY_STACK_ID_BASE, SCHEMA_ID
from trainbpf.trace.spool import SpoolWriter, finalize, spool_path_for, stored_batch

START_NS = 1_000_000_000_000
NS = 1_000_000_000

# Kernel stacks (leaf first) as the recorder symbolises them.
FAULT_STACK = ("clear_page_erms", "do_anonymous_page", "handle_mm_fault", "do_user_addr_fault", "exc_page_fault", "asm_exc_page_fault")
FAULT_IO_STACK = ("io_schedule", "folio_wait_bit_common", "filemap_fault", "__do_fault", "handle_mm_fault", "do_user_addr_fault", "exc_page_fault")
RECLAIM_STACK = ("shrink_folio_list", "shrink_lruvec", "shrink_node", "do_try_to_free_pages", "try_to_free_mem_cgroup_pages", "handle_mm_fault")
DIRTY_STACK = ("schedule_timeout", "io_schedule_timeout", "balance_dirty_pages", "balance_dirty_pages_ratelimited_flags", "generic_perform_write", "vfs_write")
MMAP_LOCK_STACK = ("schedule", "rwsem_down_write_slowpath", "down_write_killable", "__vm_munmap", "__x64_sys_munmap")
BLOCK_STACK = ("io_schedule", "blk_mq_get_tag", "submit_bio_noacct", "ext4_mpage_readpages", "filemap_read", "vfs_read")
FUTEX_STACK = ("schedule", "futex_wait_queue", "futex_wait", "do_futex", "__x64_sys_futex")
SLEEP_STACK = ("schedule", "pipe_read", "vfs_read", "ksys_read")
RECV_STACK = ("schedule", "schedule_timeout", "sk_wait_data", "tcp_recvmsg_locked", "tcp_recvmsg", "inet_recvmsg",
              "sock_recvmsg", "__sys_recvfrom")
POLL_STACK = ("schedule", "schedule_hrtimeout_range_clock", "do_sys_poll", "__x64_sys_poll")
MUNMAP_STACK = ("zap_pte_range", "unmap_page_range", "unmap_region", "do_vmi_munmap", "__vm_munmap", "__x64_sys_munmap")
GIL_USTACK = ("__futex_abstimed_wait_common", "pthread_cond_timedwait", "take_gil", "PyEval_RestoreThread", "time_sleep")
LOCK_USTACK = ("__lll_lock_wait", "pthread_mutex_lock", "arena_get2", "malloc", "PyMem_RawMalloc")


def t(seconds: float) -> int:
    """Trace clock ns of a time given in seconds from the start."""
    return START_NS + int(round(seconds * NS))


def d(seconds: float) -> int:
    return int(round(seconds * NS))


class Synth:
    """Accumulates rows per kind; `write` produces a finished trace file."""

    def __init__(
        self,
        duration_s: float = 10.0,
        *,
        target_pid: int | None = 100,
        topology: dict[str, Any] | None = None,
        gpu_source: str | None = "nvidia-smi",
        lost: dict[str, int] | None = None,
        meta: dict[str, Any] | None = None,
        clock: bool = True,
    ):
        self.duration_s = duration_s
        self.rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._stacks: dict[tuple[str, tuple[str, ...]], int] = {}
        self.meta: dict[str, Any] = {
            "schema": SCHEMA_ID,
            "host": "synth",
            "kernel": "6.18.0-synth",
            "argv": ["trainbpf", "record", "--pid", str(target_pid)],
            "target_pid": target_pid,
            "trainer_tid": None,
            "topology": topology or {"nodes": {"0": [0, 1]}, "gpus": [{"index": 0, "bus_id": "00000000:19:00.0", "node": 0}], "gpu_node": 0, "declared": False},
            "probes": ["sched", "futex", "faults", "mm", "writeback", "block"],
            "thresholds": {"min_block_ns": 1_000_000, "min_futex_ns": 1_000_000, "oncpu_hz": 99, "fault_bucket_ns": 100_000_000, "hz": 250},
            "gpu": {"source": gpu_source, "samples": 0},
            "lost": dict(lost or {}),
            "complete": True,
            "stop_reason": "duration",
        }
        if clock:
            self.meta["clock"] = {"start_mono_ns": START_NS, "end_mono_ns": t(duration_s), "wall_minus_mono_ns": 0}
        self.meta.update(meta or {})

    # -- rows -------------------------------------------------------------------------
    def add(self, kind: str, **columns: Any) -> None:
        unknown = set(columns) - set(KIND_COLUMNS[kind])
        if unknown:
            raise ValueError(f"{kind} has no columns {unknown}")
        self.rows[kind].append(columns)

    def stack(self, frames: Sequence[str] | str | None, kind: str = "kernel", pid: int | None = None) -> int | None:
        """The id of a symbolised stack (registered once); kind "python": a Python stack,
        frames "qualname (file:line)" leaf first, its id at PY_STACK_ID_BASE and up."""
        if frames is None:
            return None
        frames = tuple(frames.split(";")) if isinstance(frames, str) else tuple(frames)
        key = (kind, frames)
        if key not in self._stacks:
            python = sum(k == "python" for k, _ in self._stacks)
            sid = PY_STACK_ID_BASE + python if kind == "python" else len(self._stacks) - python + 1
            self._stacks[key] = sid
            self.add("stack", ts_ns=START_NS, kstack_id=sid, state=kind, pid=pid, name=";".join(frames))
        return self._stacks[key]

    def thread(self, tid: int, comm: str, pid: int | None = None, *, name: str = "seed", ts: float = 0.0, parent: int | None = None) -> None:
        self.add("thread", ts_ns=t(ts), tid=tid, pid=pid if pid is not None else self.meta["target_pid"], comm=comm, peer_tid=parent, name=name)

    def exit(self, tid: int, ts: float, pid: int | None = None, comm: str | None = None) -> None:
        self.add("exit", ts_ns=t(ts), tid=tid, pid=pid if pid is not None else self.meta["target_pid"], comm=comm)

    def offcpu(
        self, tid: int, ts: float, dur: float, *, state: str = "S", runq: float = 0.0, waker: int | None = None,
        kstack: Sequence[str] | None = None, ustack: Sequence[str] | None = None, cpu: int = 0, pid: int | None = None,
        pystack: Sequence[str] | None = None, waker_pystack: Sequence[str] | None = None,
    ) -> None:
        self.add(
            "offcpu", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, pid), cpu=cpu, state=state,
            runq_ns=d(runq), peer_tid=waker, peer_pid=self._pid(waker, None) if waker is not None else None,
            kstack_id=self.stack(kstack), ustack_id=self.stack(ustack, "user"),
            **self._python(pystack_id=pystack, peer_pystack_id=waker_pystack),
        )

    def _python(self, **stacks: Sequence[str] | None) -> dict[str, int]:
        """Python stack id columns for the stacks given (none: the row leaves them null)."""
        return {name: self.stack(frames, "python") for name, frames in stacks.items() if frames is not None}

    def offcpu_short(self, tid: int, ts: float, *, dur: float, count: int, runq: float = 0.0, state: str = "S") -> None:
        self.add("offcpu_short", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), state=state, count=count, runq_ns=d(runq))

    def oncpu(self, tid: int, ts: float, *, cpu: int = 0, kstack: Sequence[str] | None = None,
              pystack: Sequence[str] | None = None, ustack: Sequence[str] | None = None) -> None:
        self.add("oncpu", ts_ns=t(ts), tid=tid, pid=self._pid(tid, None), cpu=cpu, kstack_id=self.stack(kstack),
                 ustack_id=self.stack(ustack, "user"), **self._python(pystack_id=pystack))

    def oncpu_every(self, tid: int, start: float, end: float, hz: float = 99.0, *, cpu: int | Callable[[float], int] = 0,
                    kstack: Sequence[str] | None | Callable[[float], Sequence[str] | None] = None,
                    pystack: Sequence[str] | None = None, ustack: Sequence[str] | None = None) -> None:
        for ts in np.arange(start, end, 1.0 / hz):
            c = cpu(ts) if callable(cpu) else cpu
            k = kstack(ts) if callable(kstack) else kstack
            self.oncpu(tid, float(ts), cpu=c, kstack=k, pystack=pystack, ustack=ustack)

    def futex(self, tid: int, ts: float, dur: float, addr: int, *, op: int = 128 + 9, ustack: Sequence[str] | None = None,
              pystack: Sequence[str] | None = None) -> None:
        self.add("futex", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), addr=addr, op=op,
                 ustack_id=self.stack(ustack, "user"), **self._python(pystack_id=pystack))

    def futex_addr(self, addr: int, name: str, *, region: str = "image", pid: int | None = None, ts: float = 0.5) -> None:
        """What the recorder found at a futex address of process `pid` (default: the target)."""
        self.add("futex_addr", ts_ns=t(ts), pid=pid if pid is not None else self.meta["target_pid"], addr=addr,
                 state=region, name=name)

    def faults(self, tid: int, ts: float, dur: float, count: int) -> None:
        self.add("faults", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), count=count)

    def mmap_lock(self, tid: int, ts: float, dur: float, state: str = "write") -> None:
        self.add("mmap_lock", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), state=state, count=1)

    def reclaim(self, tid: int, ts: float, dur: float, pages: int = 32, state: str = "direct") -> None:
        self.add("reclaim", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), state=state, count=pages)

    def compaction(self, tid: int, ts: float, dur: float, status: int = 0) -> None:
        self.add("compaction", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), op=status)

    def mm_syscall(self, tid: int, ts: float, dur: float, name: str, size: int, addr: int = 0x7F0000000000,
                   flags: int = 0, ret: int = 0) -> None:
        """`flags`: mmap's flags, madvise's advice; `ret`: the return value (mmap's address)."""
        self.add("mm_syscall", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), name=name, addr=addr,
                 size=size, op=flags, count=ret)

    def numa_move(self, tid: int, ts: float, *, cpu: int, src: int, dst: int) -> None:
        self.add("numa_move", ts_ns=t(ts), tid=tid, pid=self._pid(tid, None), cpu=cpu, op=src, node=dst, name="move")

    def numa_maps(self, ts: float, node: int, pages: int, state: str = "end") -> None:
        self.add("numa_maps", ts_ns=t(ts), pid=self.meta["target_pid"], state=state, node=node, count=pages)

    def dirty_pause(self, tid: int, ts: float, dur: float, *, dirty: int = 50_000, limit: int = 40_000, dev: str = "nvme0n1") -> None:
        self.add("dirty_pause", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), count=dirty, size=limit, name=dev)

    def block_rq(self, tid: int, ts: float, dur: float, *, size: int = 131072, rwbs: str = "R", dev: int = 259 << 20, sector: int = 0) -> None:
        self.add("block_rq", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), size=size, name=rwbs, op=dev, addr=sector)

    # -- disk: per-bucket counts (bucket `dur` seconds from `ts`), devices as "MAJ:MIN" --
    def disk_io(self, tid: int, ts: float, *, bytes: int, direction: str = "read", comm: str = "python",
                pid: int | None = None, device: str = "254:0", dur: float = 0.1, requests: int = 1) -> None:
        self.add("disk_io", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, pid), comm=comm, name=device,
                 state=direction, size=bytes, count=requests)

    def writeback_inode(self, ts: float, inode: int, bytes: int, *, tid: int = 300, comm: str = "kworker/u8:1",
                        device: str = "254:0", dur: float = 0.1) -> None:
        self.add("writeback_inode", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=tid, comm=comm, name=device, addr=inode,
                 size=bytes)

    def dirtied(self, tid: int, ts: float, inode: int, folios: int, *, comm: str = "python", device: str = "254:0",
                dur: float = 0.1) -> None:
        self.add("dirtied", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), comm=comm, name=device,
                 addr=inode, count=folios)

    def file(self, inode: int, path: str, *, device: str = "254:0", pid: int | None = None) -> None:
        self.add("file", ts_ns=START_NS, pid=pid if pid is not None else self.meta["target_pid"], state=device,
                 addr=inode, name=path)

    def block_device(self, device: str, name: str) -> None:
        self.add("block_device", ts_ns=START_NS, state=device, name=name)

    def write_path(self, tid: int, ts: float, inode: int, path: str, bytes: int, *, device: str = "254:0",
                   dur: float = 0.1) -> None:
        self.add("write_path", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), name=device, addr=inode,
                 state=path, size=bytes, count=1)

    def memory_cgroup(self, ts: float, cgroup: str, key: str, value: float, *, pid: int | None = None) -> None:
        self.add("memory_cgroup", ts_ns=t(ts), pid=pid if pid is not None else self.meta["target_pid"], name=cgroup,
                 state=key, count=int(value))

    def page_cache(self, ts: float, inode: int, change: str, pages: int, *, device: str = "254:0",
                   dur: float = 0.1) -> None:
        self.add("page_cache", ts_ns=t(ts), dur_ns=d(dur), name=device, addr=inode, state=change, count=pages)

    # -- network: per-bucket counts (bucket `dur` seconds from `ts`), sockets by inode ----
    def socket(self, tid: int, inode: int, peer: str, *, family: str = "ipv4", protocol: int = 6,
               interface: str = "veth0", ts: float = 0.0) -> None:
        self.add("socket", ts_ns=t(ts), tid=tid, pid=self._pid(tid, None), addr=inode, state=family, name=peer,
                 op=protocol, comm=interface)

    def net_io(self, tid: int, ts: float, inode: int, bytes: int, *, direction: str = "recv", calls: int = 1,
               dur: float = 0.1) -> None:
        self.add("net_io", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), addr=inode,
                 state=direction, size=bytes, count=calls)

    def net_request(self, tid: int, ts: float, inode: int, *, requests: int, latency: float, max_latency: float,
                    dur: float = 0.1) -> None:
        """`latency`: the sum over the requests, seconds."""
        self.add("net_request", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=self._pid(tid, None), addr=inode,
                 count=requests, size=d(latency), value=float(d(max_latency)))

    def retransmit(self, ts: float, inode: int, count: int, *, dur: float = 0.1) -> None:
        self.add("retransmit", ts_ns=t(ts), dur_ns=d(dur), addr=inode, count=count)

    def net_device(self, ts: float, interface: str, bytes: int, *, direction: str = "xmit", tid: int = 0,
                   pid: int | None = None, comm: str = "", packets: int = 1, dur: float = 0.1) -> None:
        self.add("net_device", ts_ns=t(ts), dur_ns=d(dur), tid=tid, pid=pid, comm=comm, name=interface,
                 state=direction, size=bytes, count=packets)

    def gpu(self, ts: float, util: float, index: int = 0) -> None:
        self.add("gpu", ts_ns=t(ts), op=index, value=float(util), count=1000, size=10, name=f"GPU-{index}")

    def gpu_series(self, util: Callable[[float], float], period: float = 0.1, index: int = 0) -> None:
        for ts in np.arange(period, self.duration_s + 1e-9, period):
            self.gpu(float(ts), util(float(ts)), index)

    def gpu_from_running(self, tid: int, period: float = 0.1, busy: float = 95.0) -> None:
        """A GPU that is busy exactly while `tid` runs: each sample reports `busy` times
        the share of the period since the previous sample that `tid` was on-CPU."""
        off = [(r["ts_ns"], r["ts_ns"] + r["dur_ns"]) for r in self.rows["offcpu"] if r["tid"] == tid]
        for ts in np.arange(period, self.duration_s + 1e-9, period):
            lo, hi = t(float(ts) - period), t(float(ts))
            away = sum(max(0, min(hi, e) - max(lo, s)) for s, e in off)
            self.gpu(float(ts), busy * (1.0 - away / (hi - lo)))

    def lost(self, probe: str, count: int, ts: float = 0.0) -> None:
        self.add("lost", ts_ns=t(ts), name=probe, count=count)

    def _pid(self, tid: int | None, pid: int | None) -> int | None:
        if pid is not None or tid is None:
            return pid
        for row in self.rows["thread"]:
            if row["tid"] == tid:
                return row["pid"]
        return self.meta["target_pid"]

    # -- output -----------------------------------------------------------------------
    def write(self, path: Path) -> Path:
        return finalize(self.write_spool(path), Path(path))

    def write_spool(self, path: Path) -> Path:
        """The spool a recorder of `path` would leave (killed before finalising)."""
        path = Path(path)
        meta = dict(self.meta)
        meta["gpu"] = dict(meta.get("gpu") or {})
        if meta["gpu"].get("source") is not None:
            meta["gpu"]["samples"] = len(self.rows["gpu"])
        writer = SpoolWriter(path, meta)
        for kind, rows in self.rows.items():
            if not rows:
                continue
            names = sorted({k for row in rows for k in row})
            writer.add(stored_batch(kind, {n: [row.get(n) for row in rows] for n in names}))
        writer.flush()
        writer.close()
        return spool_path_for(path)

    def read(self, folder: Path, name: str = "trace.parquet"):
        return read_trace(self.write(Path(folder) / name))


def periodic(start: float, end: float, period: float) -> Iterable[float]:
    """Start times of a loop that repeats every `period` seconds."""
    return (float(x) for x in np.arange(start, end - 1e-9, period))


# -- ready-made scenarios: one injected bottleneck each ---------------------------------

TRAINER = 100
WORKER = 200


def input_pipeline(duration_s: float = 10.0, **kwargs: Any) -> Synth:
    """The trainer runs 50 ms, then waits 140 ms on a futex until worker 200, busy
    decoding all along, hands it the next batch."""
    s = Synth(duration_s, **kwargs)
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    for x in periodic(0.0, duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.05, 0.14, waker=WORKER, runq=0.001, kstack=FUTEX_STACK)
        s.futex(TRAINER, x + 0.05, 0.139, addr=0x7F00_0000_1000)
    s.gpu_from_running(TRAINER)
    return s


def healthy(duration_s: float = 10.0, *, gpu: bool = True) -> Synth:
    """The trainer runs almost all the time; brief waits for an always-ready worker."""
    s = Synth(duration_s, gpu_source="nvidia-smi" if gpu else None)
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    for x in periodic(0.0, duration_s, 0.5):
        s.offcpu(TRAINER, x + 0.3, 0.002, waker=WORKER, runq=0.0001, kstack=FUTEX_STACK)
        s.futex(TRAINER, x + 0.3, 0.002, addr=0x7F00_0000_1000)
        s.offcpu(WORKER, x + 0.1, 0.2, waker=TRAINER)
    if gpu:
        s.gpu_series(lambda ts: 92.0)
    return s


def big_trace(path: Path, events: int = 1_000_000, *, seconds: float = 60.0, threads: int = 16, seed: int = 0) -> Path:
    """A large, self-consistent trace built with numpy (for scale tests and benchmarks):
    about 60% off-CPU intervals, 20% on-CPU samples, 15% futex waits, the rest faults,
    mm calls, block requests and GPU samples.  Thread 100 trains; 200.. are workers."""
    rng = np.random.default_rng(seed)
    tids = np.array([TRAINER] + [WORKER + i for i in range(threads - 1)], dtype=np.int32)
    span = d(seconds)
    meta = Synth(seconds).meta
    writer = SpoolWriter(Path(path), meta)
    n_off = int(events * 0.6) // threads
    kstacks = {i + 1: f for i, f in enumerate((FUTEX_STACK, SLEEP_STACK, FAULT_IO_STACK, BLOCK_STACK, RECLAIM_STACK, DIRTY_STACK))}
    for sid, frames in kstacks.items():
        writer.add(stored_batch("stack", {"ts_ns": [START_NS], "kstack_id": [sid], "state": ["kernel"], "pid": [TRAINER], "name": [";".join(frames)]}))
    for i, tid in enumerate(tids):
        comm = "python" if tid == TRAINER else "pt_data_worker"
        writer.add(stored_batch("thread", {"ts_ns": [START_NS], "tid": [tid], "pid": [TRAINER], "comm": [comm], "name": ["seed"]}))
        # Alternate running and off-CPU stretches whose lengths fill the span.
        run = rng.exponential(1.0, n_off)
        off = rng.exponential(1.0, n_off)
        scale = span / (run.sum() + off.sum())
        run_ns, off_ns = (run * scale).astype(np.int64) + 1, (off * scale).astype(np.int64) + 1
        starts = START_NS + np.cumsum(run_ns) + np.concatenate([[0], np.cumsum(off_ns)[:-1]])
        waker = rng.choice(tids, n_off)
        writer.add(stored_batch("offcpu", {
            "ts_ns": starts, "dur_ns": off_ns, "tid": np.full(n_off, tid, np.int32), "pid": np.full(n_off, TRAINER, np.int32),
            "cpu": rng.integers(0, 4, n_off).astype(np.int32), "state": rng.choice(np.array(["S", "D", "R"], dtype=object), n_off, p=[0.8, 0.1, 0.1]),
            "runq_ns": (off_ns * rng.uniform(0, 0.2, n_off)).astype(np.int64),
            "peer_tid": pa.array(waker, mask=waker == tid), "kstack_id": rng.integers(1, len(kstacks) + 1, n_off).astype(np.int32),
        }))
        futex = rng.random(n_off) < 0.25
        writer.add(stored_batch("futex", {
            "ts_ns": starts[futex], "dur_ns": off_ns[futex], "tid": np.full(futex.sum(), tid, np.int32),
            "pid": np.full(futex.sum(), TRAINER, np.int32), "addr": rng.choice(np.arange(0x1000, 0x1000 + 64 * 50, 64, dtype=np.uint64), futex.sum()),
            "op": np.full(futex.sum(), 137, np.int32),
        }))
        writer.flush()
    n_on = int(events * 0.2)
    writer.add(stored_batch("oncpu", {
        "ts_ns": np.sort(START_NS + rng.integers(0, span, n_on)), "tid": rng.choice(tids, n_on),
        "pid": np.full(n_on, TRAINER, np.int32), "cpu": rng.integers(0, 4, n_on).astype(np.int32),
        "kstack_id": pa.array(rng.integers(1, len(kstacks) + 1, n_on).astype(np.int32), mask=rng.random(n_on) < 0.7),
    }))
    n_misc = int(events * 0.02)
    for kind, extra in (("faults", {"count": rng.integers(1, 500, n_misc)}),
                        ("mm_syscall", {"name": rng.choice(np.array(["mmap", "munmap"], dtype=object), n_misc), "size": rng.integers(4096, 1 << 24, n_misc)}),
                        ("block_rq", {"size": rng.integers(4096, 1 << 20, n_misc), "name": np.full(n_misc, "R", dtype=object)})):
        writer.add(stored_batch(kind, {
            "ts_ns": np.sort(START_NS + rng.integers(0, span, n_misc)), "dur_ns": rng.integers(1000, 10_000_000, n_misc),
            "tid": rng.choice(tids, n_misc), "pid": np.full(n_misc, TRAINER, np.int32), **extra,
        }))
    n_gpu = int(seconds * 10)
    writer.add(stored_batch("gpu", {
        "ts_ns": START_NS + np.arange(1, n_gpu + 1) * 100_000_000, "op": np.zeros(n_gpu, np.int32),
        "value": rng.choice([2.0, 95.0], n_gpu), "name": np.full(n_gpu, "GPU-0", dtype=object),
    }))
    writer.flush()
    writer.close()
    return finalize(spool_path_for(Path(path)), Path(path))
