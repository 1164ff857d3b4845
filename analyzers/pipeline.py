"""The analysis pipeline: `analyze` runs the analyzers over a loaded trace in order,
threads and roles -> state intervals -> causes -> GPU-starved pieces of the trainer's time
-> wake-up chains -> findings (analyzers/trainer.py), for one trainer or for every rank
of a job (analyzers/job/rank_analysis.py), and returns an `Analysis` for the report layer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.freed_late import held_back_table
from trainbpf.analyzers.causes.network import thread_traffic
from trainbpf.analyzers.findings.ranking import build_findings
from trainbpf.analyzers.intervals import Span, as_int64
from trainbpf.analyzers.job.join import JobResult, RankTables
from trainbpf.analyzers.job.rank_analysis import (
    analyze_job,
    backend_tids,
    collective_pids,
    in_collectives,
    rank_tables,
)
from trainbpf.analyzers.job.ranks import empty_ranks, job_ranks
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.threads.containers import process_containers
from trainbpf.analyzers.threads.roles import pick_trainer
from trainbpf.analyzers.threads.states import expand_slots, state_totals
from trainbpf.analyzers.timeline.cuda_calls import CudaTimeline, step_summary
from trainbpf.analyzers.trainer import Shared, TrainerPart, roles, share, trainer_part


@dataclass
class Analysis:
    """Everything `analyze` found; the report layer renders it.

    `basis` says what starved time is: "gpu_idle" (the GPU samples' idle time that the
    trainer's named stalls explain, analyzers/timeline/starvation.py) or "trainer_not_running" (no GPU
    samples: the trainer's stalled time)."""

    path: str
    meta: dict[str, Any]
    span: Span  # the whole recording
    window: Span  # the analysed part
    trainer_tid: int | None
    basis: str
    threads: pd.DataFrame  # roles.THREAD_COLUMNS
    slots: pd.DataFrame  # every thread's states, whole trace, attributed (states.SLOT_COLUMNS + futex_class)
    totals: pd.DataFrame  # ns per (tid, state) inside the window
    futex_waits: pd.DataFrame
    samples: pd.DataFrame  # on-CPU samples with their class
    gpu: pd.DataFrame  # gpu.UTIL_COLUMNS: each GPU's sample windows
    gpu_windows: pd.DataFrame  # gpu.WINDOW_COLUMNS: idle, stalls and starved ns per sample window (a job: every rank's)
    starved: pd.DataFrame  # findings.ATTRIBUTED_COLUMNS
    chains: pd.DataFrame  # chains.LINK_COLUMNS: the path each followed wait took
    chain_ends: pd.DataFrame  # chains.END_COLUMNS: where its shares ended
    churn: pd.DataFrame
    placement: pd.DataFrame
    findings: pd.DataFrame  # findings.FINDING_COLUMNS
    lost: dict[str, int]
    idle_fraction: float | None
    uses_cuda: bool = False  # the trainer's CUDA calls were traced (its GPU waits are exact)
    cuda_steps: dict[str, Any] | None = None  # cuda.step_summary of the trainer's steps
    cuda: CudaTimeline | None = None  # every thread's CUDA waits, bursts and gaps; None: CUDA not traced
    pystacks: pd.DataFrame | None = None  # stacks.python_stacks: the trace's Python stacks (states' pystack ids)
    job: JobResult | None = None  # a job of several ranks (analyzers/job/rank_analysis.py); None: one trainer
    traffic: pd.DataFrame | None = None  # network.TRAFFIC_COLUMNS: each thread's socket bytes in the window
    containers: pd.DataFrame | None = None  # containers.CONTAINER_COLUMNS: the traced processes' containers
    pages: pd.DataFrame | None = None  # huge_pages.PAGE_COLUMNS: each process's faults per MiB newly mapped
    thp: dict[str, Any] | None = None  # huge_pages.thp_state: the THP mode and counters
    shootdowns: pd.DataFrame | None = None  # tlb.CHARGE_COLUMNS: TLB shootdowns each thread received, by sender
    mm_calls: pd.DataFrame | None = None  # tlb.CALL_COLUMNS: each thread's mm syscalls in the window
    lifetimes: pd.DataFrame | None = None  # lifetimes.LIFETIME_COLUMNS: the trainer's buffers per size class
    held_frees: pd.DataFrame | None = None  # freed_late.HELD_BACK_COLUMNS: CUDA frees held back by events
    copies: dict[str, Any] | None = None  # numa.copy_sources: where the bytes copied to the GPU came from
    _states: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def states(self) -> pd.DataFrame:
        """Every thread's state intervals, whole trace, attributed (states.STATE_COLUMNS +
        futex_class): the slots expanded on first use."""
        if self._states is None:
            self._states = expand_slots(self.slots)
        return self._states

    @property
    def starved_ns(self) -> float:
        return float(self.starved["ns"].sum())

    @property
    def unfinished(self) -> bool:
        """A recording that did not finish: a spool read as it is, or a recovered one."""
        meta = self.meta
        return self.path.endswith(".spool") or meta.get("complete") is False or bool(meta.get("recovered"))

    @property
    def gpu_samples(self) -> int:
        """GPU samples (one per GPU per period) that reach into the analysed window."""
        return len(self.gpu_windows) if self.basis == "gpu_idle" else 0

    @property
    def idle_ns(self) -> float:
        """GPU idle time inside the window (GPU-averaged ns); 0 without GPU samples."""
        w = self.gpu_windows
        return float((w["idle_ns"] * w["weight"]).sum()) if self.basis == "gpu_idle" else 0.0

    @property
    def unwoken_idle_ns(self) -> float:
        """Idle time that only sleeps no traced thread ended could cover (presumed GPU
        synchronisation or timers): left out of starved time."""
        w = self.gpu_windows
        return float((w["unwoken_idle_ns"] * w["weight"]).sum())

    @property
    def gpu_bound_ns(self) -> float:
        """The trainer's time inside CUDA waits (GPU-averaged ns): GPU-bound, never starved."""
        w = self.gpu_windows
        return float((w["gpu_bound_ns"] * w["weight"]).sum())

    @property
    def host_bound_ns(self) -> float:
        """The part of starved time the trainer's own host work explains (GPU-averaged
        ns): it was busy on the CPU, outside GPU synchronisations, while the GPU idled."""
        w = self.gpu_windows
        return float((w["host_bound_ns"] * w["weight"]).sum())

    @property
    def gpu_source(self) -> str | None:
        source = (self.meta.get("gpu") or {}).get("source")
        return str(source) if source else ("gpu" if len(self.gpu) else None)


def display_path(path: Any) -> str:
    """A path as text any report can carry: bytes of a non-UTF-8 name as \\xNN escapes."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def lost_counts(meta: dict[str, Any], lost_rows: pd.DataFrame) -> dict[str, int]:
    """Lost events per probe: the metadata's counts, else the newest cumulative rows."""
    counts = {str(k): int(v) for k, v in (meta.get("lost") or {}).items() if v}
    if not counts and len(lost_rows):
        per = pd.Series(as_int64(lost_rows["lost"], 0), index=lost_rows["probe"].astype(str)).groupby(level=0).max()
        counts = {str(k): int(v) for k, v in per.items() if v > 0}
    return counts


def analyze(
    trace: Any,
    *,
    trainer_tid: int | None = None,
    window: Window | None = None,
) -> Analysis:
    """Run every analyzer over a loaded trace (trainbpf.trace.reader.Trace).  `window`: the
    analysed part, parsed at the edge (options.Window).  A trace of several
    ranks of one job (analyzers/job/ranks.py) is analysed rank by rank and as one job
    (analyzers/job/rank_analysis.py), unless `trainer_tid` names one trainer."""
    sh = share(trace, window)
    ranks = empty_ranks() if trainer_tid is not None else job_ranks(
        sh.base, trace.view("thread"), trace.view("process_env"), collective_pids(trace.view("collective")))
    if len(ranks):
        threads, parts, job, view = analyze_job(sh, ranks)
        # The report's trainer: the straggler's, else the first rank's.
        part = parts[job.straggler["rank"] if job.straggler else int(job.ranks["rank"].iloc[0])]
        # Every rank's sample windows of its own GPU, so GPU-bound, host-bound and unwoken
        # time add up over the ranks as starved time does.
        windows = pd.concat([p.gpu_windows for p in parts.values()], ignore_index=True)
        return _analysis(sh, threads, part, job.starved, job.findings, basis=view["basis"], util=view["util"],
                         gpu_idle=view["gpu_idle"], job=job, windows=windows)
    recorded = sh.meta.get("trainer_tid")  # the recorder was told which thread trains
    if trainer_tid is None and recorded is not None and int(recorded) in set(sh.base["tid"].tolist()):
        trainer = int(recorded)
    else:
        trainer = pick_trainer(sh.base, target_pid=sh.meta.get("target_pid"), trainer_tid=trainer_tid)
    states, followed = sh.trainer_states(trainer)
    threads = roles(sh, {trainer: (states, followed)} if trainer is not None else {}, named_by_user=trainer_tid is not None)
    pids = frozenset(int(p) for p in sh.base["pid"].unique())
    basis, util, windows, gpu_idle = sh.gpu(pids)
    part = trainer_part(sh, threads, trainer, states, followed, basis=basis, windows=windows)
    # Waits inside collectives of ranks this trace does not hold: nobody here to blame.
    starved = in_collectives(part, backend_tids(threads, trainer))
    findings = build_findings(starved, part.chains, part.chain_ends, part.ctx, trainer_tid=trainer, gaps=part.gaps)
    return _analysis(sh, threads, part, starved, findings, basis=basis, util=util, gpu_idle=gpu_idle)


@dataclass
class TraceRanks:
    """One trace of a job cut down for a join with other traces' (analyzers/job/join.py):
    its ranks' tables (its clock), where it ran, and what the report says of it."""

    meta: dict[str, Any]
    window: Span
    tables: list[RankTables]
    idle_fraction: float | None
    lost: dict[str, int]


def trace_ranks(trace: Any) -> TraceRanks:
    """A trace's ranks analysed as `analyze` analyses a job's, down to the tables a join
    needs; a trace holding one rank counts (the others are in other traces); no tables
    for a trace without ranks."""
    sh = share(trace, None)
    ranks = job_ranks(sh.base, trace.view("thread"), trace.view("process_env"),
                      collective_pids(trace.view("collective")), min_ranks=1)
    tables, idle = [], None
    if len(ranks):
        _, _, _, tables, view = rank_tables(sh, ranks)
        idle = view["gpu_idle"]
    return TraceRanks(meta=sh.meta, window=sh.win, tables=tables, idle_fraction=idle,
                      lost=lost_counts(sh.meta, trace.view("lost")))


def _analysis(sh: Shared, threads: pd.DataFrame, part: TrainerPart, starved: pd.DataFrame, findings: pd.DataFrame, *,
              basis: str, util: pd.DataFrame, gpu_idle: float | None,
              job: JobResult | None = None, windows: pd.DataFrame | None = None) -> Analysis:
    trace = sh.trace
    return Analysis(
        path=display_path(getattr(trace, "path", "")), meta=sh.meta, span=sh.span, window=sh.win,
        trainer_tid=part.trainer, basis=basis, threads=threads, slots=sh.slots,
        totals=state_totals(sh.slots, sh.win), futex_waits=sh.futex_waits, samples=sh.samples, gpu=util,
        gpu_windows=part.gpu_windows if windows is None else windows,
        starved=starved, chains=part.chains,
        chain_ends=part.chain_ends, churn=sh.churn, placement=sh.placement, findings=findings,
        lost=lost_counts(sh.meta, trace.view("lost")), idle_fraction=gpu_idle, uses_cuda=part.uses_cuda,
        cuda_steps=step_summary(part.step_rows) if len(part.step_rows) else None, cuda=sh.cuda,
        pystacks=sh.pystacks, job=job, traffic=thread_traffic(trace.view("net_io"), sh.win.start_ns, sh.win.end_ns),
        containers=process_containers(trace.view("container")), pages=sh.pages, thp=sh.thp,
        shootdowns=sh.shootdowns, mm_calls=sh.mm_calls, lifetimes=part.ctx.lifetimes, copies=part.ctx.copies,
        held_frees=held_back_table(part.ctx),
    )


def observed_ns(analysis: Analysis) -> pd.Series:
    """Per tid, how long the thread was observed inside the window."""
    th = analysis.threads
    lo = np.maximum(th["first_ns"].to_numpy(), analysis.window.start_ns)
    hi = np.minimum(th["last_ns"].to_numpy(), analysis.window.end_ns)
    return pd.Series(np.maximum(hi - lo, 0), index=th["tid"].to_numpy())
