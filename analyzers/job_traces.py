"""Several traces of one job analysed as one (`trainbpf analyze NODE0.parquet
NODE1.parquet ...`; docs/findings.md, "Several nodes").

Each trace is read and its ranks analysed in a worker process of its own, at most one
per CPU at once (analyzers.pipeline.trace_ranks, the code a single trace's job runs);
only each rank's small tables come back (analyzers/job/join.py, RankTables).  Here they are
checked to be the ranks of one job, put on one clock (analyzers/job/clocks.py) and joined
as one job's ranks are."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from trainbpf.analyzers.job.clocks import WARN_RESIDUAL_NS, align_traces, trace_exits
from trainbpf.analyzers.job.join import JobResult, join_ranks
from trainbpf.analyzers.pipeline import TraceRanks, display_path, trace_ranks
from trainbpf.trace.errors import JobTracesError
from trainbpf.trace.jobvars import JOB_KEY_VARIABLES
from trainbpf.trace.memory import read_for_analysis
from trainbpf.trace.reader import read_trace

# Per trace: where it is and what it holds, then how it was put on the first one's clock.
TRACE_COLUMNS = ("path", "host", "pid", "ranks", "start_ns", "end_ns")


@dataclass
class JobTraces:
    """The job of several traces: `traces` is TRACE_COLUMNS + clocks.ALIGN_COLUMNS per
    trace (start_ns, end_ns: its window on the first trace's clock); `notes` the
    warnings on its clocks, one line each."""

    traces: pd.DataFrame
    job: JobResult
    window_ns: int
    gpu: dict[str, Any]
    lost_events: int
    host_bound_ns: float
    notes: list[str]


def analyze_traces(paths: Sequence[str | os.PathLike], *, memory_check: bool = True,
                   progress: Callable[[int, int], None] | None = None) -> JobTraces:
    """The job the traces at `paths` (one per node) recorded; `progress(done, total)`
    after each trace.  Raises JobTracesError where they are not one job's traces, and
    the errors of reading a trace."""
    names = [display_path(p) for p in paths]
    _same_recording(names, [read_trace(p).meta for p in paths])  # footers only: before the work
    found = _analyse_each([os.fspath(p) for p in paths], memory_check, progress)
    _check_one_job(names, found)
    clocks = [int((f.meta.get("clock") or {}).get("wall_minus_mono_ns") or 0) for f in found]
    aligned = align_traces([trace_exits(pd.concat([t.calls for t in f.tables], ignore_index=True)) for f in found],
                           clocks)
    traces = pd.DataFrame({
        "path": names, "host": [str(f.meta.get("host") or "") for f in found],
        "pid": pd.Series([f.meta.get("target_pid") for f in found], dtype=object), "ranks": [sorted(t.rank for t in f.tables) for f in found],
        "start_ns": [f.window.start_ns + int(o) for f, o in zip(found, aligned["offset_ns"])],
        "end_ns": [f.window.end_ns + int(o) for f, o in zip(found, aligned["offset_ns"])]})
    traces = pd.concat([traces, aligned], axis=1)
    window_ns = int(traces["end_ns"].max() - traces["start_ns"].min())
    job = join_ranks([t.shifted(int(o)) for f, o in zip(found, aligned["offset_ns"]) for t in f.tables],
                     window_ns=window_ns)
    # GPU samples and host-bound time add up over the ranks, as for one trace's job.
    samples = [sum(t.gpu_samples for t in f.tables) for f in found]
    idle = [(f.idle_fraction, n) for f, n in zip(found, samples) if f.idle_fraction is not None and n]
    return JobTraces(
        traces=traces, job=job, window_ns=window_ns,
        gpu={"source": next((str(f.meta["gpu"]["source"]) for f, n in zip(found, samples)
                             if (f.meta.get("gpu") or {}).get("source") and n), None),
             "samples": sum(samples), "idle_fraction": sum(i * n for i, n in idle) / sum(n for _, n in idle) if idle else None},
        lost_events=sum(sum(f.lost.values()) for f in found),
        host_bound_ns=sum(t.host_bound_ns for f in found for t in f.tables), notes=clock_notes(traces))


def clock_notes(traces: pd.DataFrame) -> list[str]:
    """A warning per trace whose clock was far off its wall-clock offset, or that its
    collectives could not align."""
    notes = []
    for t in traces.itertuples(index=False):
        if t.aligned_by == "wall clock":
            notes.append(f"{t.path} ({t.host or '?'}): only {t.matched} of its {t.exits} collectives matched the first "
                         "trace's: aligned by its wall clock alone")
        elif abs(t.residual_ns) > WARN_RESIDUAL_NS:
            notes.append(f"{t.path} ({t.host or '?'}): its clock was {t.residual_ns / 1e6:+.1f} ms off its wall-clock "
                         "offset (aligned by collectives): that node's clock is badly synchronised")
    return notes


def _same_recording(names: list[str], metas: list[dict[str, Any]]) -> None:
    """Refuse one node's recording given twice: the same host, started at the same instant."""
    seen: dict[tuple[str, int], str] = {}
    for name, meta in zip(names, metas):
        start = (meta.get("clock") or {}).get("start_mono_ns")
        if start is None:
            continue
        key = (str(meta.get("host") or ""), int(start))
        if key in seen:
            raise JobTracesError(f"{seen[key]} and {name} are the same recording (host {key[0] or '?'}, started at the "
                                 "same instant): give each node's trace once")
        seen[key] = name


def _analyse_trace(path: str, memory_check: bool) -> TraceRanks:
    """One trace's ranks, in a worker process: read, analysed, cut down to tables."""
    found = trace_ranks(read_for_analysis(path, memory_check=memory_check))
    name = display_path(path)
    if not found.tables:
        raise JobTracesError(f"{name}: no rank of a job in this trace (no traced process has RANK or its equivalents, "
                             "nor threads of a collective backend): record each node's launcher (--pid LAUNCHER)")
    if any(t.source != "environment" for t in found.tables):
        raise JobTracesError(f"{name}: its ranks are known by behaviour only (the trace holds no rank variables such as "
                             "RANK), so they cannot be matched to other traces' ranks; analyse it alone")
    return found


def _analyse_each(paths: list[str], memory_check: bool,
                  progress: Callable[[int, int], None] | None) -> list[TraceRanks]:
    """_analyse_trace of every path, in worker processes (at most one per CPU at once;
    each started afresh, so nothing of the parent's state is shared)."""
    out: list[TraceRanks | None] = [None] * len(paths)
    workers = max(1, min(len(paths), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_analyse_trace, path, memory_check): i for i, path in enumerate(paths)}
        try:
            for done, future in enumerate(as_completed(futures), 1):
                out[futures[future]] = future.result()
                if progress is not None:
                    progress(done, len(paths))
        except BrokenProcessPool:
            raise JobTracesError("a worker process analysing the traces died (out of memory?); analyse fewer "
                                 "traces at once, or where more memory is free") from None
        finally:
            for future in futures:
                future.cancel()
    return [f for f in out if f is not None]


def _job_keys(found: TraceRanks) -> dict[str, str]:
    """What its ranks' environments say of their job: the JOB_KEY_VARIABLES and WORLD_SIZE."""
    keys: dict[str, str] = {}
    for t in found.tables:
        for part in t.job.split(";"):
            name, _, value = part.partition("=")
            if name in JOB_KEY_VARIABLES:
                keys.setdefault(name, value)
        if t.world_size >= 0:
            keys.setdefault("WORLD_SIZE", str(t.world_size))
    return keys


def _check_one_job(names: list[str], found: list[TraceRanks]) -> None:
    """Refuse traces that are not one job's, each node once: one node's processes
    recorded twice, ranks of different jobs, one rank in two traces."""
    pids: dict[tuple[str, frozenset[int]], str] = {}
    for name, f in zip(names, found):
        key = (str(f.meta.get("host") or ""), frozenset(t.pid for t in f.tables))
        if key in pids:
            raise JobTracesError(f"{pids[key]} and {name} recorded the same processes of host {key[0] or '?'}: "
                                 "two recordings of one node; give one of them")
        pids[key] = name
    jobs: dict[str, tuple[str, str]] = {}
    for name, f in zip(names, found):
        for variable, value in _job_keys(f).items():
            first = jobs.setdefault(variable, (value, name))
            if first[0] != value:
                raise JobTracesError(f"{first[1]} and {name} hold ranks of different jobs ({variable}={first[0]} and "
                                     f"{variable}={value}): give the traces of one job")
    ranks: dict[int, str] = {}
    for name, f in zip(names, found):
        for t in f.tables:
            if t.rank in ranks:
                raise JobTracesError(f"rank {t.rank} is in both {ranks[t.rank]} and {name}: give each node's trace once")
            ranks[t.rank] = name
