"""`trainbpf record`: attach the probes to a process tree and write one trace file."""

from __future__ import annotations

import contextlib
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
from trainbpf.trace.safefile import OutputFile
from trainbpf.trace.schema import SCHEMA_ID
from trainbpf.trace.spool import SpoolWriter, combine, finalize, make_batch
from trainbpf.tracer import access, loader, preflight, proctree, sources
from trainbpf.tracer.collector import Collector, ThreadTable
from trainbpf.tracer.drain import DrainLoop
from trainbpf.tracer.record_config import RecordConfig
from trainbpf.tracer.record_output import RecordResult, check_output
from trainbpf.tracer.ringbuf import open_rings
from trainbpf.tracer.samplers import procfs
from trainbpf.tracer.samplers.clock import wall_minus_mono_ns
from trainbpf.tracer.settings import Settings
from trainbpf.tracer.source import Source
from trainbpf.tracer.symbols.maps import ProcMaps


def check_target(pid: int) -> None:
    if pid <= 0 or not proctree.is_alive(pid):
        raise TargetError(f"no such process: {pid} (--pid takes a process id, the kernel's tgid)")


class Recorder(DrainLoop):
    """One recording session.  run() reads top to bottom: open (check the privileges, the
    target, the output and the machine; choose the probes; open every source) -> load
    (compile the probes; their tracepoints attach as they load) -> start (the sources
    ready what takes time; the spool opens) -> attach (seed the traced tree, then every
    source) -> drain (flush every source's rows into the spool every FLUSH_INTERVAL_S
    until a stop) -> stop (what is still open ends with the recording) -> finalise (the
    spool becomes the trace file).  Each phase calls one hook of every source
    (tracer/source.py), in the order of self.sources; none is known here by name."""

    def __init__(self, config: RecordConfig, *, status: Callable[[str], None] | None = None,
                 on_attached: Callable[[], None] | None = None, notice: Callable[[str], None] | None = None):
        # What was asked for.
        self.config = config
        self.pid = config.pid
        self.duration = config.duration
        self.settings = config.settings  # with what the machine says, once open
        self.status = status
        self.on_attached = on_attached
        self.notice = notice
        # Under sudo: only the processes the invoking user could ptrace are traced.
        self.gate = access.Gate(config.invoker, notice) if config.invoker is not None else None
        self.stop_reason = ""
        self._stop = threading.Event()
        self._stop_fds: tuple[int, int] | None = None  # a pipe the drain loop waits on, while it runs
        # Held to write to or close that pipe: a thread must never write to its descriptor
        # once closed (the number may name another file by then).  Reentrant: a signal
        # handler runs in the main thread, perhaps while it holds the lock.
        self._stop_fds_lock = threading.RLock()
        # What the session holds, from open to finalise.
        self.probes: list[Collector] = []  # the BPF collectors chosen
        self.sources: list[Source] = []  # the probes, then sources.SOURCES: each opened in turn
        self.wall_minus_mono = 0
        self.seed: list[proctree.ThreadInfo] = []  # the tree walked before the probes load
        self.out: OutputFile | None = None  # the output's folder, opened once and checked
        self.declared_topology: dict | None = None
        self.bpf = None
        self.rings = None  # the ring-buffer readers, once open
        self.writer: SpoolWriter | None = None
        self.meta: dict = {}
        self.threads = ThreadTable()  # every thread seen, and those that exited
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
        try:
            self._open()
            self.bpf = loader.load(self.probes, self.settings)  # compile before the spool exists
            self._start()
            self._open_spool()
            try:
                self._attach()
                self._drain()
                self._stop_tracing()
                return self._finalise()
            finally:
                self.writer.release()  # the spool's lock, whatever happened
        finally:
            # Each runs even if one before it raises (which is then raised): a source that
            # fails to close leaves no program attached and no other source open.
            with contextlib.ExitStack() as closing:
                if self.bpf is not None:
                    closing.callback(loader.detach, self.bpf)  # every program and perf event we attached
                if self.rings is not None:
                    closing.callback(self.rings.close)
                for source in reversed(self.sources):
                    closing.callback(source.close)

    def _open(self) -> None:
        """Everything that can be refused before a probe is compiled (tracer/preflight.py:
        what `trainbpf doctor` checks), the sources opened and the tree walked."""
        config = self.config
        preflight.require(preflight.check_privileges)
        if self.pid is not None:
            check_target(self.pid)
        if self.gate is not None:
            self.gate.check_target(self.pid)
        self.out = check_output(config.output, force=config.force, notice=self.notice)
        if config.topology_file is not None:  # read now: a bad one is refused before the compile
            self.declared_topology = procfs.declared_topology(config.topology_file)
        preflight.require(*preflight.ENVIRONMENT)
        self.settings = Settings(**{**self.settings.__dict__, "hz": procfs.kernel_hz(),
                                    "exec_leaves": self.gate is not None})
        self.probes = loader.select(list(config.probes) if config.probes else None, self.settings)
        self.wall_minus_mono = wall_minus_mono_ns()
        for source in self.probes + [cls() for cls in sources.SOURCES]:
            self.sources.append(source)  # closed from now on, whatever happens
            source.open(self)
        self.seed = self._walk()
        if config.trainer_tid is not None and config.trainer_tid not in {t.tid for t in self.seed}:
            raise UsageError(f"--trainer-tid {config.trainer_tid} is not a thread of the traced processes")

    def _start(self) -> None:
        """What the drain needs that takes time (kallsyms alone, tens of ms): done before
        the recording's clock starts."""
        self.rings = open_rings(self.bpf, loader.event_dtypes(self.bpf, self.probes))
        self.meta = {}
        for source in self.sources:
            self.meta.update(source.start())

    def _open_spool(self) -> None:
        if self.pid is not None and not proctree.is_alive(self.pid):
            raise TargetError(f"process {self.pid} exited before the probes attached")
        self.meta = {**self._meta(), **self.meta}
        # The start is taken last, just before the seed: a killed recording's spool keeps
        # this clock, and whatever ran between it and the seed would pass for running time.
        self.start_ns = self.meta["clock"]["start_mono_ns"] = time.monotonic_ns()
        self.writer = SpoolWriter(self.config.output, self.meta, out=self.out)

    def _attach(self) -> None:
        """The recording starts here: the tree is seeded from the start (just taken), and
        threads already blocked begin their off-CPU interval then."""
        self._seed(self.seed)
        walked = self._walk()  # again: threads born between the first walk and the attach
        self._seed(walked)
        for source in self.sources:
            for batch in source.seed(walked):
                self.writer.add(batch)
        self.writer.flush()
        if self.on_attached:
            self.on_attached()

    def _stop_tracing(self) -> None:
        self.end_ns = time.monotonic_ns()
        for batch in self._ended(self.end_ns, final=True):
            self.writer.add(batch)
            self.rows += batch.num_rows
        self.writer.flush()
        self.writer.close(keep_open=True)  # finalised from this descriptor, still locked
        self.duration_s = time.monotonic() - self.start_ns / 1e9

    def _finalise(self) -> RecordResult:
        writer = self.writer
        if writer.failed:
            kept = "nothing was recorded: its empty spool is removed" if writer.remove_if_empty() else \
                f"what was recorded is kept in {writer.spool} (`trainbpf recover {writer.spool}`)"
            raise OutputError(f"{writer.failed}; {kept}")
        final = {
            "complete": True,
            "stop_reason": self.stop_reason,
            "lost": self.lost,
            "clock": {**self.meta["clock"], "start_mono_ns": self.start_ns, "end_mono_ns": self.end_ns},
            "missed_runs": loader.missed_runs(self.bpf),
        }
        for source in self.sources:
            final.update(source.meta())
        final.update(self.gate.meta() if self.gate else {})
        try:
            written = finalize(writer.spool, self.config.output, final, spool_fd=writer.fd,
                               force=self.config.force, out=self.out)
        except OutputError as exc:
            raise OutputError(f"{exc}; what was recorded is kept in {writer.spool}") from exc
        finally:
            writer.release()
        return RecordResult.of(written, {**self.meta, **final}, duration_s=self.duration_s, rows=self.rows,
                               threads=len(self.threads.tgid), size=self.out.size())

    # -- parts -----------------------------------------------------------------------
    def _meta(self) -> dict:
        """The trace's opening metadata, before what the sources add (Source.start)."""
        return {
            "schema": SCHEMA_ID,
            "host": socket.gethostname(),
            "kernel": platform.release(),
            "argv": sys.argv,
            "target_pid": self.pid,
            "target_cmdline": proctree.cmdline(self.pid) if self.pid else [],
            "trainer_tid": self.config.trainer_tid,
            "clock": {
                "start_mono_ns": 0,  # set by _open_spool, as the last step before the seed
                "wall_minus_mono_ns": self.wall_minus_mono,
                "source": "CLOCK_MONOTONIC",
            },
            "probes": [c.name for c in self.probes],
            "thresholds": self.settings.thresholds(),
            "system_wide": self.settings.trace_all,
            "complete": False,
        }

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
        for pid in back:
            walked = proctree.tree_threads(pid, exclude=os.getpid())
            self._seed(walked)
            self.threads.joined(walked, time.monotonic_ns())  # a wait since the exec begins now
        return [ended] if ended is not None else []

    def _described(self, batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
        """The thread rows of a flush as one batch (each step below runs once), without
        those of processes that left, and what the symbolisers add about them."""
        rows = combine(batches)
        if rows is not None and self.gate is not None:
            rows = self.gate.drop_left(rows)
        if rows is None:
            return []
        maps = ProcMaps()  # read once for this flush, by every symboliser
        described: list[pa.RecordBatch] = []
        for source in self.sources:
            rows, more = source.describe(rows, maps)
            described += more
        return [rows] + described

    def _ended(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        ended: list[pa.RecordBatch] = []
        for source in self.sources:
            ended = source.end(now_ns, ended, final=final)
        return ended

    def _flush(self, *, final: bool) -> None:
        """One flush: the traced threads' rows with what names them, then the sources'
        own samples; then the lost counts."""
        now_ns = time.monotonic_ns()
        rows = [b for s in self.sources if s.described for b in s.flush(now_ns, final=final)]
        ended = self._after_execs()
        batches = self._described(rows) + ended  # then the sources' own: after the execs, a process let back in is read anew
        batches += [b for s in self.sources if not s.described for b in s.flush(now_ns, final=final)]
        if not final:  # what a killed recording's last segment says was still blocked
            segment_ns = time.monotonic_ns()
            batches += self._ended(segment_ns, final=False)
            batches.append(make_batch("segment", {"ts_ns": np.array([segment_ns], dtype=np.int64)}))
        for b in batches:
            self.writer.add(b)
        gone, self.threads.unforgotten = self.threads.unforgotten, []  # drained: the map entries can go
        loader.untrace(self.bpf, gone)
        for source in self.sources:
            source.exited(gone)
        self.rows += sum(b.num_rows for b in batches)
        self.lost = loader.lost_counts(self.bpf)
        if any(self.lost.values()):
            n = time.monotonic_ns()
            self.writer.add(make_batch("lost", {
                "ts_ns": np.full(len(self.lost), n, dtype=np.int64), "probe": list(self.lost),
                "lost": np.array(list(self.lost.values()), dtype=np.int64)}))
        self.writer.flush()


def record(*, config: RecordConfig, status: Callable[[str], None] | None = None,
           on_attached: Callable[[], None] | None = None, notice: Callable[[str], None] | None = None,
           handle_signals: bool = True) -> RecordResult:
    """Record what `config` asks (tracer/record_config.py) until its duration passes, the
    target exits, or SIGINT/SIGTERM.  `status`: a progress line each flush; `on_attached`
    runs once the probes are live and the tree is seeded; `notice`: one-line news."""
    rec = Recorder(config, status=status, on_attached=on_attached, notice=notice)
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
