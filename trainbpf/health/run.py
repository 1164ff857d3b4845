"""One health check from start to end: take the lock, bound the run in time, choose the
targets, record one short trace, analyse it once per target and once for the node,
grade, and write the outputs whatever happened (a run that could not check says so)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from trainbpf.analyzers.timeline.node import node_check_values, node_metrics
from trainbpf.health.config import (
    DEFAULT_LOCK_FILE,
    TEXTFILE_NAME,
    UNKNOWN,
    HealthConfig,
    Threshold,
)
from trainbpf.health.outputs import write_outputs
from trainbpf.health.results import (
    HealthResult,
    TargetResult,
    failed_result,
    grade_report,
    make_check,
    overall_status,
    step_metrics,
)
from trainbpf.health.targets import (
    Target,
    find_targets,
    recording_root,
    scan_processes,
    target_trees,
    tree_tids,
)
from trainbpf.trace.asuser import as_root, files
from trainbpf.trace.errors import OutputError, TrainbpfError
from trainbpf.trace.safefile import check_output
from trainbpf.tracer.preflight import check_privileges, require
from trainbpf.tracer.proctree import is_alive

if TYPE_CHECKING:
    from trainbpf.reports.document import Report

# The hard backstop fires this long after the time limit when the soft stop did not
# end the run (the main thread stuck where signals cannot reach it, e.g. a compile).
BACKSTOP_GRACE_S = 10.0
NODE_FAULT_READ_NS = 1_000_000_000  # every thread on the node: its fault counters read once a second
LOCK_CONTENT_MAX = 32  # a pid and a newline


class HealthBusy(TrainbpfError):
    """Another health check holds the lock."""

    exit_code = UNKNOWN


class CheckTimeout(TrainbpfError):
    exit_code = UNKNOWN


class CheckInterrupted(TrainbpfError):
    exit_code = UNKNOWN


def _analysis_error(what: str, exc: Exception) -> str:
    """A failed analysis in one line."""
    if isinstance(exc, TrainbpfError):
        return f"{what}: {exc}"
    return f"{what}: analysis failed ({type(exc).__name__}: {exc})"


def analyze_job(trace: Any) -> Report | None:
    """The trace analysed as `trainbpf analyze` does without `--trainer-tid`, when that
    finds a job of several ranks (analyzers/job/rank_analysis.py); None for one process."""
    from trainbpf.analyzers.pipeline import analyze
    from trainbpf.reports.document import Report

    analysis = analyze(trace)
    return Report.of(analysis) if analysis.job is not None else None


def analyze_target(*, trace: Any, target: Target, tids: set[int], thresholds: Mapping[str, Threshold],
                   job: Report | None = None) -> TargetResult:
    """Grade one target from `trainbpf analyze`'s report of the loaded `trace` with the
    target's main thread as the trainer; `tids` are the threads of its process tree.  A
    target whose tree holds two or more ranks of `job` (a launcher) is graded from the
    job's report instead."""
    from trainbpf.analyzers.pipeline import analyze
    from trainbpf.reports.document import Report

    try:
        if job is not None and len(tids & set(job.analysis.job.ranks["pid"].tolist())) >= 2:
            report = job
        else:
            report = Report.of(analyze(trace, trainer_tid=target.pid))
    except Exception as exc:  # a crash in analysis is "could not check", never "healthy"
        return TargetResult(target, error=_analysis_error(f"pid {target.pid}", exc))
    return grade_report(target, report.doc, tids=tids, thresholds=thresholds,
                        steps=step_metrics(report.analysis.uses_cuda, report.analysis.cuda_steps,
                                           faults=_tree_faults(report.analysis.churn, tids)))


def _tree_faults(churn: Any, tids: set[int]) -> int:
    """Page faults the threads `tids` took in the analysed window (the churn table's)."""
    return int(churn.loc[churn["tid"].isin(list(tids)), "faults"].sum())


def assess(*, trace_path: Path, targets: list[Target], trees: Mapping[int, tuple[set[int], set[int]]],
           config: HealthConfig, started: float, host: str) -> HealthResult:
    """Grade a recorded trace, read once: the job it holds (when it holds several ranks),
    every target, then the node.  `trees` maps a target to the (process ids, thread ids)
    of its tree when it was chosen."""
    from trainbpf.trace.reader import read_trace

    trace = read_trace(trace_path)
    node = node_metrics(trace)
    threads = trace.frame("thread")
    job, errors = None, []
    if targets:
        try:
            job = analyze_job(trace)
        except Exception as exc:  # "could not check" too
            errors.append(_analysis_error("job", exc))
    results = []
    for t in targets:
        pids, tids = trees.get(t.pid, ({t.pid}, {t.pid}))
        results.append(analyze_target(trace=trace, target=t, tids=tree_tids(threads, pids=pids, tids=tids),
                                      thresholds=config.thresholds, job=job))
    checks = [make_check("starved_ratio", r.starved_ratio, config.thresholds, r.target.pid) for r in results if r.error is None]
    checks += [make_check(name, value, config.thresholds) for name, value in node_check_values(node).items()]
    error = "; ".join(errors + [r.error for r in results if r.error]) or None
    return HealthResult(overall_status(checks, results, error), host, started, time.time(),
                        "targets" if targets else "node", results, node, checks, error, config,
                        job=None if job is None else {"ranks": job.doc["ranks"], "straggler": job.doc["straggler"]})


def _open_lock(path: Path) -> tuple[int, int]:
    """The lock file's descriptor and the uid it must belong to.  Opened as the user who
    named it (under sudo, the kernel refuses a file they cannot write), except the
    node's default lock, which is root's; never through a symlink."""
    opener = as_root() if path == DEFAULT_LOCK_FILE else contextlib.nullcontext()
    with opener:
        lock_files = files()
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            return lock_files.open(os.fsencode(path), flags, 0o644), lock_files.uid
        except OSError as exc:
            # ELOOP, or EACCES for another user's symlink in a sticky folder
            why = "is a symbolic link; remove it" if os.path.islink(path) else exc.strerror or exc
            raise OutputError(f"lock file {path}: {why}") from None


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """A non-blocking flock on `path`: a second run raises HealthBusy instead of waiting
    (the kernel drops the lock when the process ends, however it ends)."""
    fd, uid = _open_lock(path)
    try:
        # Only our own plain file, holding nothing or a pid: a lock file named in a
        # config must not truncate whatever file it points at.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
            raise OutputError(f"lock file {path} is not a plain file of uid {uid}'s own; remove it")
        held = os.pread(fd, LOCK_CONTENT_MAX + 1, 0)
        if not re.fullmatch(rb"(\d+\n)?", held):
            raise OutputError(f"lock file {path} holds something other than a health check's pid; "
                              "not ours to overwrite: name another lock_file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = held.decode().strip() or "?"
            raise HealthBusy(f"another health check (pid {holder}) holds {path}; this run skipped") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def time_limit(seconds: float, *, on_backstop: Callable[[], None] | None = None,
               grace_s: float = BACKSTOP_GRACE_S) -> Iterator[threading.Event]:
    """Bound the block to `seconds`.  At the limit SIGALRM ends it: during a recording it
    raises SIGTERM, which the recorder answers by stopping and detaching its probes; at
    any other point it raises CheckTimeout.  SIGTERM and SIGINT raise CheckInterrupted.
    If the block is still running `grace_s` later, `on_backstop` runs and the process
    exits 3 (the kernel detaches whatever it still held).  Yields the event that says the
    limit was reached.  Signals work only in the main thread; elsewhere only the
    backstop applies."""
    expired = threading.Event()
    done = threading.Event()

    def backstop() -> None:
        if done.wait(seconds + grace_s):
            return
        sys.stderr.write(f"trainbpf: error: health check still running {grace_s:g} s after its "
                         f"time limit of {seconds:g} s; ending it\n")
        if on_backstop is not None:
            with contextlib.suppress(Exception):
                on_backstop()
        os._exit(UNKNOWN)

    def interrupted(signum, _frame) -> None:
        raise CheckInterrupted(f"interrupted by {signal.Signals(signum).name}")

    def alarm(_signum, _frame) -> None:
        expired.set()
        if signal.getsignal(signal.SIGTERM) is not interrupted:  # the recorder's handler
            signal.raise_signal(signal.SIGTERM)
        else:
            raise CheckTimeout(f"time limit of {seconds:g} s reached")

    watchdog = threading.Thread(target=backstop, name="health-backstop", daemon=True)
    watchdog.start()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    try:
        if in_main:
            for sig, handler in ((signal.SIGALRM, alarm), (signal.SIGTERM, interrupted), (signal.SIGINT, interrupted)):
                previous[sig] = signal.signal(sig, handler)
            signal.setitimer(signal.ITIMER_REAL, seconds)
        yield expired
    finally:
        if in_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        done.set()


def check_outputs(config: HealthConfig) -> None:
    """Fail before recording when an output cannot be written."""
    textfile = config.textfile_dir / TEXTFILE_NAME if config.textfile_dir is not None else None
    for path, what in ((textfile, "textfile"), (config.json_file, "output"), (config.trace_file, "output")):
        if path is not None:
            check_output(path, force=True, what=what).close()  # replaced each run, but never a symlink or device


TEMP_PREFIX = "trainbpf-health-"


def remove_stale_temp_dirs(folder: str | None = None) -> list[str]:
    """Remove the temporary folders (and the spools in them) of health runs that were
    killed: ours (same uid), named for a process that no longer runs.  Returns their names."""
    folder = folder or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if not entry.name.startswith(TEMP_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            pid = entry.name[len(TEMP_PREFIX):].split("-")[0]
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid() or (pid.isdigit() and is_alive(int(pid))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)  # does not follow symlinks inside
            removed.append(entry.name)
    return removed


def _record(*, root: int | None, output: Path, config: HealthConfig, expired: threading.Event) -> None:
    from trainbpf.tracer.record import record
    from trainbpf.tracer.record_config import RecordConfig
    from trainbpf.tracer.settings import Settings

    # No Python frames: a node-wide check would attach to every Python process on the node.
    # Node-wide, every thread's fault counters are read once a second, not ten times.
    settings = Settings(trace_all=root is None, python_frames=False,
                        **({"fault_bucket_ns": NODE_FAULT_READ_NS} if root is None else {}))
    asked = RecordConfig(pid=root, output=output, duration=config.duration_s, settings=settings, gpu=config.gpu,
                         force=True)  # the trace of the previous run
    result = record(config=asked, handle_signals=threading.current_thread() is threading.main_thread())
    if expired.is_set():
        raise CheckTimeout(f"time limit of {config.limit_s:g} s reached while recording")
    if result.stop_reason in ("interrupted", "terminated"):
        raise CheckInterrupted(f"recording {result.stop_reason}")


def _check(config: HealthConfig, *, started: float, host: str, expired: threading.Event,
           progress: dict[str, Any]) -> HealthResult:
    processes = scan_processes(device_glob=config.device_glob)
    targets = find_targets(processes, pids=config.pids, command_patterns=config.command_patterns,
                           exclude_patterns=config.exclude_patterns)
    progress["targets"] = targets
    root = recording_root(processes, [t.pid for t in targets])
    trees = target_trees(processes, targets)
    with contextlib.ExitStack() as stack:
        if config.trace_file is not None:
            trace_path = config.trace_file
            from trainbpf.trace.spool import discard_stale_spool, spool_path_for

            discard_stale_spool(spool_path_for(trace_path))  # a killed run's scratch
        else:
            # Root's own scratch, private to root even under sudo (docs/security.md): the
            # trace may be node-wide, and nobody but root names or sees this folder.
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
            trace_path = Path(folder) / "trace.parquet"
            stack.enter_context(as_root())
        _record(root=root, output=trace_path, config=config, expired=expired)
        return assess(trace_path=trace_path, targets=targets, trees=trees, config=config,
                      started=started, host=host)


def run_health(*, config: HealthConfig) -> HealthResult:
    """One health check with its outputs written.  Raises HealthBusy when another run
    holds the lock and UsageError/OutputError before anything is measured; every later
    failure becomes a result with status 3 (written, so the fleet sees it)."""
    require(check_privileges)  # what `trainbpf record` and `doctor` ask for
    check_outputs(config)
    host = socket.gethostname()
    with exclusive_lock(config.lock_file):
        remove_stale_temp_dirs()
        started = time.time()
        progress: dict[str, Any] = {}

        def give_up() -> None:
            write_outputs(failed_result(config=config, started=started, host=host, targets=progress.get("targets"),
                                        error=f"time limit of {config.limit_s:g} s reached; the run was ended"), config)

        try:
            with time_limit(config.limit_s, on_backstop=give_up) as expired:
                result = _check(config, started=started, host=host, expired=expired, progress=progress)
        except TrainbpfError as exc:
            result = failed_result(config=config, started=started, host=host, error=str(exc),
                                   targets=progress.get("targets"))
        except Exception as exc:  # a crash must read "could not check" in Prometheus too
            traceback.print_exc(file=sys.stderr)  # for the bug report
            result = failed_result(config=config, started=started, host=host, targets=progress.get("targets"),
                                   error=f"internal error: {type(exc).__name__}: {exc}")
        write_outputs(result, config)
        return result
