"""`trainbpf record`: attach the probes to a process tree and write one trace file."""

from __future__ import annotations

import os
import platform
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf import doctor
from trainbpf.errors import NotRootError, OutputError, TargetError, UsageError
from trainbpf.schema import SCHEMA_ID
from trainbpf.safefile import check_output as safe_check_output
from trainbpf.tracefile import SpoolWriter, check_spool_free, finalize, make_batch, spool_path_for
from trainbpf.tracer import loader, proctree, procfs, taskstats
from trainbpf.tracer.addrs import AddressDescriber, ProcMaps, futex_pairs
from trainbpf.tracer.collector import Settings
from trainbpf.tracer.gpu import GpuSampler, wall_minus_mono_ns
from trainbpf.tracer.ringbuf import open_rings
from trainbpf.tracer.sched import TASK_EXEC, TASK_EXIT, SchedCollector
from trainbpf.tracer.stacks import StackSymbolizer, drop_irq_wakers, stack_refs

FLUSH_INTERVAL_S = 1.0
POLL_MS = 100
FINAL_DRAIN_PASSES = 4  # bounded: a target still running keeps producing


@dataclass
class RecordResult:
    output: Path
    duration_s: float
    rows: int
    lost: dict[str, int]
    stop_reason: str
    threads: int
    gpu_source: str | None
    bytes: int
    probes: tuple[str, ...] = ()
    cuda_libraries: int = 0  # CUDA library files probed


def check_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError("recording needs root (BPF and tracefs): run it with sudo")


def check_target(pid: int) -> None:
    if pid <= 0 or not proctree.is_alive(pid):
        raise TargetError(f"no such process: {pid} (--pid takes a process id, the kernel's tgid)")


def check_output(output: Path, *, force: bool = False) -> None:
    """Before anything is compiled: the output may be written (safefile.check_output),
    and its spool is neither another recorder's nor an unrecovered recording."""
    safe_check_output(output, force=force)
    check_spool_free(spool_path_for(output))


class Recorder:
    def __init__(self, *, pid: int | None, output: Path, duration: float | None, settings: Settings,
                 probes: list[str] | None, gpu: str, topology_file: Path | None,
                 status: Callable[[str], None] | None, trainer_tid: int | None = None,
                 on_attached: Callable[[], None] | None = None, force: bool = False,
                 notice: Callable[[str], None] | None = None):
        self.pid = pid
        self.force = force
        self.output = output
        self.duration = duration
        self.settings = settings
        self.probe_names = probes
        self.gpu_mode = gpu
        self.topology_file = topology_file
        self.status = status
        self.trainer_tid = trainer_tid
        self.on_attached = on_attached
        self.notice = notice
        self.stop_reason = ""
        self._stop = threading.Event()
        self._rings = None  # the ring-buffer readers, once open
        self.threads: dict[int, int] = {}  # tid -> tgid, every thread seen
        self.exited: set[int] = set()
        self.gpu_processes: list[dict] = []  # [{pid, uuid}] at the start
        self.futex_addrs = AddressDescriber()

    # -- lifecycle -------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    def run(self) -> RecordResult:
        check_root()
        if self.pid is not None:
            check_target(self.pid)
        check_output(self.output, force=self.force)
        doctor.preflight()
        hz = procfs.kernel_hz()
        self.settings = Settings(**{**self.settings.__dict__, "hz": hz})
        collectors = loader.select(self.probe_names, self.settings)
        for c in collectors:
            c.notice = self.notice
        wall_minus_mono = wall_minus_mono_ns()
        gpu = GpuSampler(mode=self.gpu_mode, wall_minus_mono_ns=wall_minus_mono)
        gpu.check()

        seed = self._walk()
        if self.trainer_tid is not None and self.trainer_tid not in {t.tid for t in seed}:
            raise UsageError(f"--trainer-tid {self.trainer_tid} is not a thread of the traced processes")
        bpf = loader.load(collectors, self.settings)  # compile before the spool exists
        try:
            if self.pid is not None and not proctree.is_alive(self.pid):
                raise TargetError(f"process {self.pid} exited before the probes attached")
            gpu.start()
            self.gpu_processes = gpu.processes({t.pid for t in seed} | ({self.pid} if self.pid else set()))
            self.meta = self._meta(collectors, wall_minus_mono, gpu)
            writer = SpoolWriter(self.output, self.meta)
            try:
                return self._record(bpf, collectors, writer, gpu, seed)
            finally:
                gpu.stop()
                writer.release()  # the spool's lock, whatever happened
        finally:
            if self._rings is not None:
                self._rings.close()
            loader.detach(bpf)  # every program and perf event we attached

    def _meta(self, collectors, wall_minus_mono: int, gpu: GpuSampler) -> dict:
        return {
            "schema": SCHEMA_ID,
            "host": socket.gethostname(),
            "kernel": platform.release(),
            "argv": sys.argv,
            "target_pid": self.pid,
            "target_cmdline": proctree.cmdline(self.pid) if self.pid else [],
            "trainer_tid": self.trainer_tid,
            "clock": {
                "start_mono_ns": time.monotonic_ns(),
                "wall_minus_mono_ns": wall_minus_mono,
                "source": "CLOCK_MONOTONIC",
            },
            "topology": procfs.topology(gpu.gpus, self.topology_file),
            "probes": [c.name for c in collectors],
            "thresholds": self.settings.thresholds(),
            "gpu": {**gpu.meta(), "processes": self.gpu_processes},
            "delayacct": taskstats.delayacct_enabled(),
            "system_wide": self.settings.trace_all,
            "complete": False,
        }

    def _gpu_processes(self, gpu: GpuSampler, tgids: list[int]) -> list[dict]:
        """The traced processes' GPUs seen at the start or now (at the stop)."""
        now = gpu.processes(set(tgids)) if gpu.source else []
        merged = {(p["pid"], p["uuid"]): p for p in self.gpu_processes + now}
        return [merged[k] for k in sorted(merged)]

    def _walk(self) -> list[proctree.ThreadInfo]:
        if self.pid is not None:  # never the recorder's own tree (--pid 1 holds it)
            return proctree.tree_threads(self.pid, exclude=os.getpid())
        return [t for t in proctree.all_threads() if t.pid != os.getpid()]

    def _seed(self, bpf, writer: SpoolWriter, threads: list[proctree.ThreadInfo]) -> None:
        new = [t for t in threads if t.tid not in self.threads]
        if not new:
            return
        for t in new:
            if not self.settings.trace_all:  # node-wide, the probes trace every tid anyway
                loader.set_traced(bpf, t.tid, t.pid)
            self.threads[t.tid] = t.pid
        now = time.monotonic_ns()
        writer.add(make_batch("thread", {
            "ts_ns": np.full(len(new), now, dtype=np.int64),
            "tid": np.array([t.tid for t in new], dtype=np.int32),
            "pid": np.array([t.pid for t in new], dtype=np.int32),
            "comm": [t.comm for t in new],
            "peer_tid": np.array([t.parent_tid for t in new], dtype=np.int32),
            "name": ["seed"] * len(new),
        }))

    def _record(self, bpf, collectors, writer: SpoolWriter, gpu: GpuSampler, seed) -> RecordResult:
        rings = self._rings = open_rings(bpf, loader.event_dtypes(bpf, collectors))
        owner = {rb: c for c in collectors for rb in c.ringbufs}
        symbolizer = StackSymbolizer(bpf)
        procsampler = procfs.ProcSampler()

        # The recording starts here: the tree is seeded from now, and threads already
        # blocked begin their off-CPU interval now.
        self.start_ns = time.monotonic_ns()
        self._seed(bpf, writer, seed)
        walked = self._walk()  # again: threads born between the first walk and the attach
        self._seed(bpf, writer, walked)
        sched = next(c for c in collectors if isinstance(c, SchedCollector))
        sched.seed_blocked(bpf, walked, self.start_ns)
        tgids = sorted(set(self.threads.values()))
        for c in collectors:
            c.seeded(bpf, tgids)
        for batch in (procfs.numa_maps_batch(tgids, "start"), taskstats.snapshot(dict(self.threads), "start")):
            if batch is not None:
                writer.add(batch)
        writer.flush()
        if self.on_attached:
            self.on_attached()

        start = self.start_ns / 1e9
        deadline = start + self.duration if self.duration else None
        next_flush = start + FLUSH_INTERVAL_S
        total_rows = 0
        lost: dict[str, int] = {}
        while True:
            # Records arrive without a wake-up (probes/common.h submit_flags): the poll
            # returns after POLL_MS, or early when a burst forces a wake-up.
            rings.poll(POLL_MS)
            now = time.monotonic()
            if deadline and now >= deadline:
                self.request_stop("duration")
            if self.pid is not None and not proctree.is_alive(self.pid):
                self.request_stop("target exited")
            # Read once: a signal arriving during the flush below must not end the loop
            # before the ring buffers are drained, so it takes effect next time round.
            stopping = self._stop.is_set()
            if now >= next_flush or stopping:
                if stopping:
                    rings.drain(passes=FINAL_DRAIN_PASSES)  # what is still in the ring buffers
                total_rows += self._flush(bpf, collectors, rings, owner, symbolizer, writer, gpu, procsampler,
                                          final=stopping)
                lost = loader.lost_counts(bpf)
                if any(lost.values()):
                    n = time.monotonic_ns()
                    writer.add(make_batch("lost", {
                        "ts_ns": np.full(len(lost), n, dtype=np.int64), "name": list(lost),
                        "count": np.array(list(lost.values()), dtype=np.int64)}))
                writer.flush()
                next_flush = now + FLUSH_INTERVAL_S
                if writer.failed:
                    self.request_stop("output failed")
                if self.status:
                    self.status(f"recording {now - start:6.1f}s  events {total_rows}  "
                                f"lost {sum(lost.values())}  written {writer.bytes_written / 1e6:.1f} MB")
            if stopping:
                break

        end_ns = time.monotonic_ns()
        live = {tid for tid in self.threads if tid not in self.exited}
        for batch in sched.open_intervals(bpf, end_ns, live):
            writer.add(batch)
            total_rows += batch.num_rows
        tgids = sorted({tg for tid, tg in self.threads.items()})
        live = {tid: tg for tid, tg in self.threads.items() if tid not in self.exited}
        for batch in (procfs.numa_maps_batch(tgids, "end"), taskstats.snapshot(live, "end")):
            if batch is not None:
                writer.add(batch)
        writer.flush()
        writer.close(keep_open=True)  # finalised from this descriptor, still locked
        duration = time.monotonic() - start
        if writer.failed:
            raise OutputError(f"{writer.failed}; what was recorded is kept in {writer.spool} "
                              f"(`trainbpf recover {writer.spool}`)")
        final = {
            "complete": True,
            "stop_reason": self.stop_reason,
            "lost": lost,
            "clock": {**self.meta["clock"], "start_mono_ns": self.start_ns, "end_mono_ns": end_ns},
            "gpu": {**gpu.meta(), "samples": gpu.count, "process_samples": gpu.process_count,
                    "processes": self._gpu_processes(gpu, tgids)},
            "stacks": {"frames": self.settings.stack_frames, "entries": self.settings.stack_entries,
                       **loader.stack_counts(bpf)},
        }
        for c in collectors:
            final.update(c.meta())
        try:
            finalize(writer.spool, self.output, final, spool_fd=writer.fd, force=self.force)
        except OutputError as exc:
            raise OutputError(f"{exc}; what was recorded is kept in {writer.spool}") from exc
        finally:
            writer.release()
        return RecordResult(self.output, duration, total_rows, lost, self.stop_reason,
                            len(self.threads), gpu.source, self.output.stat().st_size,
                            tuple(c.name for c in collectors), len(final.get("cuda", {}).get("libraries", ())))

    def _flush(self, bpf, collectors, rings, owner, symbolizer, writer, gpu, procsampler, *, final: bool) -> int:
        now_ns = time.monotonic_ns()
        batches: list[pa.RecordBatch] = []
        for rb in owner:
            records = rings.take(rb)
            if records is not None and len(records):
                batches += owner[rb].decode(rb, records)
                if rb == "task_events":
                    self._track_tasks(bpf, records)
                    if (records["what"] == TASK_EXEC).any():
                        symbolizer.exec_seen()
                        self.futex_addrs.exec_seen()
        for c in collectors:
            batches += c.drain(bpf, now_ns, final=final)
        # Kernel stacks first: they tell which wake-ups came from interrupt context, whose
        # "waker" (and its user stack) must be dropped before user stacks are resolved.
        refs = [stack_refs(b) for b in batches]
        kernel = np.concatenate([k for k, _ in refs]) if refs else np.empty(0, np.int64)
        sym_kernel = symbolizer.symbolize(kernel, [])
        batches = [drop_irq_wakers(b, symbolizer.irq_ids) for b in batches]
        user = [stack_refs(b)[1] for b in batches]
        maps = ProcMaps()  # read once for this flush, by both
        sym_user = symbolizer.symbolize([], np.concatenate(user) if user else [], maps)
        described = self.futex_addrs.describe(futex_pairs(batches), maps)
        batches += [s for s in (sym_kernel, sym_user, described) if s is not None]
        gpu_batch = gpu.take()
        if gpu_batch is not None:
            batches.append(gpu_batch)
        batches += procsampler.take()
        if not final:  # what a killed recording's last segment says was still blocked
            segment_ns = time.monotonic_ns()
            sched = next(c for c in collectors if isinstance(c, SchedCollector))
            live = {tid for tid in self.threads if tid not in self.exited}
            batches += sched.open_intervals(bpf, segment_ns, live, kind="offcpu_open")
            batches.append(make_batch("segment", {"ts_ns": np.array([segment_ns], dtype=np.int64)}))
        for b in batches:
            writer.add(b)
        for tid in list(self.exited):  # drained: the map entries can go
            loader.untrace(bpf, tid)
        return sum(b.num_rows for b in batches)

    def _track_tasks(self, bpf, records: np.ndarray) -> None:
        for tid, pid, what in zip(records["tid"].tolist(), records["pid"].tolist(), records["what"].tolist()):
            if what == TASK_EXIT:
                self.exited.add(tid)
            else:
                self.threads.setdefault(tid, pid)


def record(*, pid: int | None, output: Path, duration: float | None = None,
           settings: Settings | None = None, probes: list[str] | None = None, gpu: str = "auto",
           topology_file: Path | None = None, status: Callable[[str], None] | None = None,
           trainer_tid: int | None = None, handle_signals: bool = True,
           on_attached: Callable[[], None] | None = None, force: bool = False,
           notice: Callable[[str], None] | None = None) -> RecordResult:
    """Record `pid`'s process tree (or, with pid None and settings.trace_all, the whole
    machine) into `output` until `duration` passes, the target exits, or SIGINT/SIGTERM.
    `on_attached` runs once the probes are live and the tree is seeded.  An existing
    `output` is replaced only with `force`."""
    rec = Recorder(pid=pid, output=Path(output), duration=duration, settings=settings or Settings(),
                   probes=probes, gpu=gpu, topology_file=topology_file, status=status,
                   trainer_tid=trainer_tid, on_attached=on_attached, force=force, notice=notice)
    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig, name in ((signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")):
            previous[sig] = signal.signal(sig, lambda *_a, n=name: rec.request_stop(n))
    try:
        return rec.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
