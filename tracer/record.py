"""`trainbpf record`: attach the probes to a process tree and write one trace file."""

from __future__ import annotations

import os
import platform
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.errors import OutputError, TargetError, UsageError
from trainbpf.trace.schema import SCHEMA_ID
from trainbpf.trace.asuser import Invoker
from trainbpf.trace.safefile import OutputFile
from trainbpf.trace.spool import SpoolWriter, combine, finalize, make_batch
from trainbpf.tracer import access, loader, preflight, proctree
from trainbpf.tracer.collectors import jobenv
from trainbpf.tracer.samplers import procfs, taskstats
from trainbpf.tracer.symbols.addrs import AddressDescriber, futex_pairs
from trainbpf.tracer.symbols.maps import ProcMaps
from trainbpf.tracer.collector import Collector, ThreadTable
from trainbpf.tracer.settings import Settings
from trainbpf.tracer.drain import DrainLoop
from trainbpf.tracer.samplers.clock import wall_minus_mono_ns
from trainbpf.tracer.samplers.gpu import GpuSampler
from trainbpf.tracer.symbols.pystacks import PythonStacks
from trainbpf.tracer.record_output import RecordResult, check_output
from trainbpf.tracer.ringbuf import open_rings
from trainbpf.tracer.symbols.stacks import StackSymbolizer, drop_irq_wakers, kernel_refs, user_refs

# vmstat and PSI are summed over the recording: sampled this often, and at the stop.
PROC_SAMPLE_S = 5.0


def check_target(pid: int) -> None:
    if pid <= 0 or not proctree.is_alive(pid):
        raise TargetError(f"no such process: {pid} (--pid takes a process id, the kernel's tgid)")


class Recorder(DrainLoop):
    """One recording session.  run() reads top to bottom: open (check the privileges, the
    target, the output and the machine; choose the probes) -> load (compile the probes;
    their tracepoints attach as they load) -> attach (seed the traced tree, open the
    spool) -> drain (flush the ring buffers and the in-kernel aggregates into the spool
    every FLUSH_INTERVAL_S until a stop) -> stop (what is still open ends with the
    recording) -> finalise (the spool becomes the trace file)."""

    def __init__(self, *, pid: int | None, output: Path, duration: float | None, settings: Settings,
                 probes: list[str] | None, gpu: str, topology_file: Path | None,
                 status: Callable[[str], None] | None, trainer_tid: int | None = None,
                 on_attached: Callable[[], None] | None = None, force: bool = False,
                 notice: Callable[[str], None] | None = None, invoker: Invoker | None = None):
        # What was asked for.
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
        # Under sudo: only the processes the invoking user could ptrace are traced.
        self.gate = access.Gate(invoker, notice) if invoker is not None else None
        # Each traced process's rank variables (`process_env` rows), the target's in `job`.
        self.jobenv = jobenv.JobEnvReader(admitted=self.gate.admits if self.gate else None)
        self.target_env: dict[str, str] | None = None
        self.stop_reason = ""
        self._stop = threading.Event()
        self._stop_fds: tuple[int, int] | None = None  # a pipe the drain loop waits on, while it runs
        # Held to write to or close that pipe: a thread must never write to its descriptor
        # once closed (the number may name another file by then).  Reentrant: a signal
        # handler runs in the main thread, perhaps while it holds the lock.
        self._stop_fds_lock = threading.RLock()
        # What the session holds, from open to finalise.
        self.collectors: list[Collector] = []
        self.gpu: GpuSampler | None = None
        self.wall_minus_mono = 0
        self.seed: list[proctree.ThreadInfo] = []  # the tree walked before the probes load
        self.out: OutputFile | None = None  # the output's folder, opened once and checked
        self.declared_topology: dict | None = None
        self.bpf = None
        self.rings = None  # the ring-buffer readers, once open
        self.writer: SpoolWriter | None = None
        self.symbolizer: StackSymbolizer | None = None
        self.pystacks: PythonStacks | None = None  # with settings.python_frames
        self.procsampler: procfs.ProcSampler | None = None
        self.meta: dict = {}
        self.threads = ThreadTable()  # every thread seen, and those that exited
        self.gpu_processes: list[dict] = []  # [{pid, uuid}] at the start
        self.futex_addrs = AddressDescriber()
        self.start_ns = 0
        self.end_ns = 0
        self.duration_s = 0.0
        self.rows = 0
        self.lost: dict[str, int] = {}

    # -- lifecycle -------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()
            with self._stop_fds_lock:
                if self._stop_fds is not None:  # end the drain loop's wait (a signal handler, a thread)
                    try:
                        os.write(self._stop_fds[1], b"x")
                    except OSError:  # already full: the loop is awake
                        pass

    def run(self) -> RecordResult:
        self._open()
        self.bpf = loader.load(self.collectors, self.settings)  # compile before the spool exists
        try:
            self._prepare()
            self._open_spool()
            try:
                self._attach()
                self._drain()
                self._stop_tracing()
                return self._finalise()
            finally:
                self.gpu.stop()
                self.writer.release()  # the spool's lock, whatever happened
        finally:
            for c in self.collectors:
                c.close()
            if self.symbolizer is not None:
                self.symbolizer.close()
            if self.pystacks is not None:
                self.pystacks.close()
            if self.rings is not None:
                self.rings.close()
            if self.procsampler is not None:
                self.procsampler.close()
            loader.detach(self.bpf)  # every program and perf event we attached

    def _open(self) -> None:
        """Everything that can be refused before a probe is compiled (tracer/preflight.py:
        what `trainbpf doctor` checks), the probes chosen and the tree walked."""
        preflight.require(preflight.check_privileges)
        if self.pid is not None:
            check_target(self.pid)
        if self.gate is not None:
            self.gate.check_target(self.pid)
        if self.pid is not None:
            self.target_env = self.jobenv.read(self.pid)
        self.out = check_output(self.output, force=self.force, notice=self.notice)
        if self.topology_file is not None:  # read now: a bad one is refused before the compile
            self.declared_topology = procfs.declared_topology(self.topology_file)
        preflight.require(*preflight.ENVIRONMENT)
        self.settings = Settings(**{**self.settings.__dict__, "hz": procfs.kernel_hz(),
                                    "exec_leaves": self.gate is not None})
        self.collectors = loader.select(self.probe_names, self.settings)
        for c in self.collectors:
            c.notice = self.notice
            if c.name == "sched" and self.gate is not None:
                c.peer_visible = self.gate.sees
        self.wall_minus_mono = wall_minus_mono_ns()
        self.gpu = GpuSampler(mode=self.gpu_mode)
        self.gpu.check()
        self.seed = self._walk()
        if self.trainer_tid is not None and self.trainer_tid not in {t.tid for t in self.seed}:
            raise UsageError(f"--trainer-tid {self.trainer_tid} is not a thread of the traced processes")

    def _open_spool(self) -> None:
        if self.pid is not None and not proctree.is_alive(self.pid):
            raise TargetError(f"process {self.pid} exited before the probes attached")
        self.gpu.start()
        self.gpu_processes = self.gpu.processes({t.pid for t in self.seed} | ({self.pid} if self.pid else set()))
        self.meta = self._meta()
        # The start is taken last, just before the seed: a killed recording's spool keeps
        # this clock, and whatever ran between it and the seed would pass for running time.
        self.start_ns = self.meta["clock"]["start_mono_ns"] = time.monotonic_ns()
        self.writer = SpoolWriter(self.output, self.meta, out=self.out)

    def _prepare(self) -> None:
        """What the drain needs that takes time (kallsyms alone, tens of ms): done before
        the recording's clock starts."""
        self.rings = open_rings(self.bpf, loader.event_dtypes(self.bpf, self.collectors))
        self.symbolizer = StackSymbolizer(self.bpf)
        self.symbolizer.load_kernel_symbols()
        self.threads.exec_listeners += [self.symbolizer.exec_seen, self.futex_addrs.exec_seen]

    def _attach(self) -> None:
        """The recording starts here: the tree is seeded from the start (just taken), and
        threads already blocked begin their off-CPU interval then."""
        self._seed(self.seed)
        self.procsampler = procfs.ProcSampler(interval_ns=int(PROC_SAMPLE_S * 1e9))  # starts within the trace
        walked = self._walk()  # again: threads born between the first walk and the attach
        self._seed(walked)
        envs = self.jobenv.take(self.threads)
        if envs is not None:
            self.writer.add(envs)
        note = jobenv.lone_rank_note(self.pid, self.target_env, list(self.jobenv.envs.values()))
        if note and self.notice:
            self.notice(note)
        for c in self.collectors:
            c.seeded(self.bpf, walked, self.threads, self.start_ns)
        if self.settings.python_frames:
            cpus, entries = loader.py_stack_table()
            self.pystacks = PythonStacks(self.bpf, cpus=cpus, stack_entries=entries, notice=self.notice)
            self.threads.exec_listeners.append(self.pystacks.exec_seen)
            self.pystacks.track(self.threads)
        tgids = self.threads.tgids()
        for batch in (procfs.numa_maps_batch(tgids, "start"), taskstats.snapshot(dict(self.threads.tgid), "start")):
            if batch is not None:
                self.writer.add(batch)
        self.writer.flush()
        if self.on_attached:
            self.on_attached()

    def _stop_tracing(self) -> None:
        self.end_ns = time.monotonic_ns()
        for c in self.collectors:
            for batch in c.still_open(self.bpf, self.threads, self.end_ns, final=True):
                # Python stacks of threads blocked to the end, read while they still are
                for b in self.pystacks.fill_blocked(batch, self.end_ns) if self.pystacks else [batch]:
                    self.writer.add(b)
                    self.rows += b.num_rows
        tgids = self.threads.tgids()
        for batch in (procfs.numa_maps_batch(tgids, "end"), taskstats.snapshot(self.threads.live(), "end")):
            if batch is not None:
                self.writer.add(batch)
        self.writer.flush()
        named = self.symbolizer.finish(self.end_ns)  # user stacks are named after the stop (tracer/symbols/stacks.py)
        if named is not None:
            self.writer.add(named)
            self.writer.flush()
        self.writer.close(keep_open=True)  # finalised from this descriptor, still locked
        self.duration_s = time.monotonic() - self.start_ns / 1e9

    def _finalise(self) -> RecordResult:
        writer, gpu = self.writer, self.gpu
        if writer.failed:
            kept = "nothing was recorded: its empty spool is removed" if writer.remove_if_empty() else \
                f"what was recorded is kept in {writer.spool} (`trainbpf recover {writer.spool}`)"
            raise OutputError(f"{writer.failed}; {kept}")
        final = {
            "complete": True,
            "stop_reason": self.stop_reason,
            "lost": self.lost,
            "clock": {**self.meta["clock"], "start_mono_ns": self.start_ns, "end_mono_ns": self.end_ns},
            "gpu": {**gpu.meta(), "samples": gpu.count, "process_samples": gpu.process_count,
                    "processes": self._gpu_processes(self.threads.tgids())},
            "stacks": {"frames": self.settings.stack_frames, "entries": self.settings.stack_entries,
                       **loader.stack_counts(self.bpf)},
            "missed_runs": loader.missed_runs(self.bpf),
        }
        for c in self.collectors:
            final.update(c.meta())
        final.update(self.pystacks.meta() if self.pystacks else {"python_frames": {"enabled": False}})
        final.update(self.gate.meta() if self.gate else {})
        try:
            written = finalize(writer.spool, self.output, final, spool_fd=writer.fd, force=self.force, out=self.out)
        except OutputError as exc:
            raise OutputError(f"{exc}; what was recorded is kept in {writer.spool}") from exc
        finally:
            writer.release()
        libraries = {probe: len(final.get(probe, {}).get("libraries", ())) for probe in ("cuda", "nccl")}
        return RecordResult(written, self.duration_s, self.rows, self.lost, self.stop_reason,
                            len(self.threads.tgid), gpu.source, self.out.size(),
                            tuple(c.name for c in self.collectors),
                            cuda_libraries=libraries["cuda"], nccl_libraries=libraries["nccl"])

    # -- parts -----------------------------------------------------------------------
    def _meta(self) -> dict:
        return {
            "schema": SCHEMA_ID,
            "host": socket.gethostname(),
            "kernel": platform.release(),
            "argv": sys.argv,
            "target_pid": self.pid,
            "target_cmdline": proctree.cmdline(self.pid) if self.pid else [],
            "trainer_tid": self.trainer_tid,
            "job": jobenv.job_meta(self.target_env),
            "clock": {
                "start_mono_ns": 0,  # set by _open_spool, as the last step before the seed
                "wall_minus_mono_ns": self.wall_minus_mono,
                "source": "CLOCK_MONOTONIC",
            },
            "topology": procfs.topology(self.gpu.gpus, self.declared_topology),
            "probes": [c.name for c in self.collectors],
            "thresholds": self.settings.thresholds(),
            "gpu": {**self.gpu.meta(), "processes": self.gpu_processes},
            "delayacct": taskstats.delayacct_enabled(),
            "system_wide": self.settings.trace_all,
            "complete": False,
        }

    def _gpu_processes(self, tgids: list[int]) -> list[dict]:
        """The traced processes' GPUs seen at the start or now (at the stop)."""
        now = self.gpu.processes(set(tgids)) if self.gpu.source else []
        merged = {(p["pid"], p["uuid"]): p for p in self.gpu_processes + now}
        return [merged[k] for k in sorted(merged)]

    def _walk(self) -> list[proctree.ThreadInfo]:
        if self.pid is not None:  # never the recorder's own tree (--pid 1 holds it)
            return proctree.tree_threads(self.pid, exclude=os.getpid())
        return [t for t in proctree.all_threads() if t.pid != os.getpid()]

    def _seed(self, threads: list[proctree.ThreadInfo]) -> None:
        new = [t for t in threads if t.tid not in self.threads.tgid]
        checked = time.monotonic_ns()
        if self.gate is not None:
            new = self.gate.admit(new, checked)
        for t in new:
            if not self.settings.trace_all:  # node-wide, the probes trace every tid anyway
                loader.set_traced(self.bpf, t.tid, t.pid)
            self.threads.tgid[t.tid] = t.pid
        if self.gate is not None:
            new = self.gate.confirm(self.bpf, new, self.threads, checked)
        if not new:
            return
        now = time.monotonic_ns()
        self.writer.add(make_batch("thread", {
            "ts_ns": np.full(len(new), now, dtype=np.int64),
            "tid": np.array([t.tid for t in new], dtype=np.int32),
            "pid": np.array([t.pid for t in new], dtype=np.int32),
            "comm": [t.comm for t in new],
            "peer_tid": np.array([t.parent_tid for t in new], dtype=np.int32),
            "event": ["seed"] * len(new),
        }))
        gone = [t for t in new if t.state in ("Z", "X")]  # a main thread that called pthread_exit
        if gone:  # exited before the recording: observed for no time (analyzers/threads/roles.py)
            self.writer.add(make_batch("exit", {
                "ts_ns": np.full(len(gone), now, dtype=np.int64), "comm": [t.comm for t in gone],
                "tid": np.array([t.tid for t in gone], dtype=np.int32),
                "pid": np.array([t.pid for t in gone], dtype=np.int32)}))

    def _after_execs(self) -> list[pa.RecordBatch]:
        """Under sudo, the processes that exec'd (which the probes took out of the traced
        set): let back in, with what they started since, or kept out (`exit` rows)."""
        if self.gate is None:
            return []
        back, ended = self.gate.after_execs(self.bpf, self.threads)
        sched = next(c for c in self.collectors if c.name == "sched")
        for pid in back:
            walked = proctree.tree_threads(pid, exclude=os.getpid())
            self._seed(walked)
            sched.seed_blocked(self.bpf, walked, time.monotonic_ns())  # a wait since the exec begins now
        return [ended] if ended is not None else []

    def _with_symbols(self, batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
        """`batches`, and the stacks and futex addresses they refer to.  Kernel stacks
        first: they tell which wake-ups came from interrupt context, whose "waker" (the
        task that happened to be interrupted) is dropped from the rows."""
        rows = combine(batches)  # one batch: each step below runs once
        if rows is not None and self.gate is not None:
            rows = self.gate.drop_left(rows)
        if rows is None:
            return []
        sym_kernel = self.symbolizer.symbolize(kernel_refs(rows), [])
        rows = drop_irq_wakers(rows, self.symbolizer.irq_id_array())
        maps = ProcMaps()  # read once for this flush, by both
        sym_user = self.symbolizer.symbolize([], user_refs(rows), maps)
        # only the futex probe records futex rows: looking for them costs ~0.2 ms a flush
        described = self.futex_addrs.describe(futex_pairs(rows), maps) \
            if any(c.name == "futex" for c in self.collectors) else None
        return [rows] + [s for s in (sym_kernel, sym_user, described) if s is not None]

    def _flush(self, *, final: bool) -> None:
        """One flush: every probe's records and aggregates, their stacks and futex
        addresses, the GPU and /proc samples; then the lost counts."""
        now_ns = time.monotonic_ns()
        batches = [b for c in self.collectors for b in c.take(self.rings, self.threads)]
        ended = self._after_execs()
        for c in self.collectors:
            batches += c.drain(self.bpf, now_ns, final=final)
        envs = self.jobenv.take(self.threads)  # after the execs: a process let back in is read anew
        batches = self._with_symbols(batches) + ended + ([envs] if envs is not None else [])
        if self.pystacks is not None:  # named while the processes live, then new threads
            named = self.pystacks.take(now_ns)
            if named is not None:
                batches.append(named)
            self.pystacks.track(self.threads)
        gpu_batch = self.gpu.take()
        if gpu_batch is not None:
            batches.append(gpu_batch)
        batches += self.procsampler.take(final=final)
        if not final:  # what a killed recording's last segment says was still blocked
            segment_ns = time.monotonic_ns()
            for c in self.collectors:
                batches += c.still_open(self.bpf, self.threads, segment_ns, final=False)
            batches.append(make_batch("segment", {"ts_ns": np.array([segment_ns], dtype=np.int64)}))
        for b in batches:
            self.writer.add(b)
        gone, self.threads.unforgotten = self.threads.unforgotten, []  # drained: the map entries can go
        loader.untrace(self.bpf, gone)
        for c in self.collectors:
            c.forget(self.bpf, gone)
        self.rows += sum(b.num_rows for b in batches)
        self.lost = loader.lost_counts(self.bpf)
        if any(self.lost.values()):
            n = time.monotonic_ns()
            self.writer.add(make_batch("lost", {
                "ts_ns": np.full(len(self.lost), n, dtype=np.int64), "probe": list(self.lost),
                "lost": np.array(list(self.lost.values()), dtype=np.int64)}))
        self.writer.flush()


def record(*, pid: int | None, output: Path, duration: float | None = None,
           settings: Settings | None = None, probes: list[str] | None = None, gpu: str = "auto",
           topology_file: Path | None = None, status: Callable[[str], None] | None = None,
           trainer_tid: int | None = None, handle_signals: bool = True,
           on_attached: Callable[[], None] | None = None, force: bool = False,
           notice: Callable[[str], None] | None = None, invoker: Invoker | None = None) -> RecordResult:
    """Record `pid`'s process tree (or, with pid None and settings.trace_all, the whole
    machine) into `output` until `duration` passes, the target exits, or SIGINT/SIGTERM.
    `on_attached` runs once the probes are live and the tree is seeded.  An existing
    `output` is replaced only with `force`.  `invoker`: the sudo user, whose rights limit
    which processes are traced (tracer/access.py)."""
    rec = Recorder(pid=pid, output=Path(output), duration=duration, settings=settings or Settings(),
                   probes=probes, gpu=gpu, topology_file=topology_file, status=status,
                   trainer_tid=trainer_tid, on_attached=on_attached, force=force, notice=notice,
                   invoker=invoker)
    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig, name in ((signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")):
            previous[sig] = signal.signal(sig, lambda *_a, n=name: rec.request_stop(n))
    try:
        return rec.run()
    finally:
        if rec.out is not None:  # the output's folder, opened by run's checks
            rec.out.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
