"""The analysis pipeline: `analyze` runs the analyzers over a loaded trace in order,
threads and roles -> state intervals -> causes -> GPU-starved pieces of the trainer's time
-> wake-up chains -> findings, and returns an `Analysis` for the report layer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.analyzers.attribution import EXACT_RUN_KINDS, RunSplit, attribute_states, churn_threads, sample_classes
from trainbpf.analyzers.chains import followed_waits, is_followed, wait_chains
from trainbpf.analyzers.cuda import (CudaTimeline, gpu_waits, launch_bursts, split_at_waits, step_summary, steps,
                                     timeline)
from trainbpf.analyzers.evidence import EvidenceContext
from trainbpf.analyzers.findings import attribute_starved, build_findings
from trainbpf.analyzers.gpu import (
    gpu_utilisation, idle_fraction, idle_stretches, job_gpus, sample_windows, starved_pieces, whole_window,
)
from trainbpf.analyzers.host import HostSplit, host_labels
from trainbpf.analyzers.intervals import Span, as_int64, dense_rank, resolve_window, trace_span
from trainbpf.analyzers.numa import gpu_node, memory_placement, thread_placement
from trainbpf.analyzers.roles import assign_roles, observed_threads, pick_trainer
from trainbpf.analyzers.stacks import classify_stacks, python_stacks
from trainbpf.analyzers.states import PYTHON_ID_COLUMNS, expand_slots, state_slots, state_totals
from trainbpf.analyzers.vocab import codes
from trainbpf.analyze_options import GPU_IDLE_THRESHOLD, Window
from trainbpf.schema import KIND_COLUMNS
from trainbpf.tracefile import release_unused_memory


@dataclass
class Analysis:
    """Everything `analyze` found; the report layer renders it.

    `basis` says what starved time is: "gpu_idle" (the GPU samples' idle time that the
    trainer's named stalls explain, analyzers/gpu.py) or "trainer_not_running" (no GPU
    samples: the trainer's stalled time)."""

    path: str
    meta: dict[str, Any]
    span: Span  # the whole recording
    window: Span  # the analysed part
    trainer_tid: int | None
    gpu_idle_threshold: float
    basis: str
    threads: pd.DataFrame  # roles.THREAD_COLUMNS
    slots: pd.DataFrame  # every thread's states, whole trace, attributed (states.SLOT_COLUMNS + futex_class)
    totals: pd.DataFrame  # ns per (tid, state) inside the window
    futex_waits: pd.DataFrame
    samples: pd.DataFrame  # on-CPU samples with their class
    gpu: pd.DataFrame  # gpu.UTIL_COLUMNS: each GPU's sample windows
    idle: pd.DataFrame  # stretches below gpu_idle_threshold inside the window (drawing only)
    gpu_windows: pd.DataFrame  # gpu.WINDOW_COLUMNS: idle, stalls and starved ns per sample window
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


def _seen(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """(tid, pid, first_ns) of every tid with rows; `frames`: the rows (tid, pid, ts_ns)
    of every kind that has a tid."""
    parts = []
    for rows in frames:
        table = pa.table({name: pa.array(rows[name]) for name in ("tid", "pid", "ts_ns")})
        if table["tid"].null_count:
            table = table.filter(pc.is_valid(table["tid"]))
        if table.num_rows:
            parts.append(table.group_by("tid", use_threads=False).aggregate([("pid", "max"), ("ts_ns", "min")]))
    if not parts:
        return pd.DataFrame({"tid": np.zeros(0, np.int64), "pid": np.zeros(0, np.int64), "first_ns": np.zeros(0, np.int64)})
    agg = pa.concat_tables(parts, promote_options="permissive").group_by("tid", use_threads=False).aggregate(
        [("pid_max", "max"), ("ts_ns_min", "min")]).to_pandas()
    return pd.DataFrame({"tid": as_int64(agg["tid"]), "pid": as_int64(agg["pid_max_max"]), "first_ns": as_int64(agg["ts_ns_min_min"], 0)})


def display_path(path: Any) -> str:
    """A path as text any report can carry: bytes of a non-UTF-8 name as \\xNN escapes."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def _wake_counts(trainer_states: pd.DataFrame, followed: np.ndarray, trainer: int | None) -> pd.Series:
    """Per waker tid, how many of the trainer's followed waits (not lock handoffs) it ended."""
    wakers = trainer_states["waker_tid"].to_numpy(np.int64)[followed]
    return pd.Series(wakers[wakers != trainer]).value_counts()


# The offcpu columns the analyzers read.
OFFCPU_COLUMNS = ("ts_ns", "dur_ns", "tid", "pid", "cpu", "state", "runq_ns", "peer_tid", "kstack_id", "ustack_id")
# The oncpu columns the analyzers read.  Python stack ids (offcpu: states.PYTHON_ID_COLUMNS,
# oncpu: pystack_id) are read only from a trace that holds Python stacks.
ONCPU_COLUMNS = ("ts_ns", "tid", "pid", "cpu", "kstack_id", "ustack_id")
# The kinds whose rows name a thread: every one of them shows when a thread was seen.
THREAD_KINDS = tuple(kind for kind, columns in KIND_COLUMNS.items() if "tid" in columns)
# Threads whose CPU use is the input pipeline's own.
PIPELINE_ROLES = ("trainer", "dataloader", "pin_memory")


def cpus_used(*, offcpu_cpu: np.ndarray, samples: pd.DataFrame) -> int:
    """How many CPUs the traced threads ran on (switch-in CPUs and sample CPUs)."""
    cpus = np.concatenate([as_int64(offcpu_cpu), samples["cpu"].to_numpy(np.int64)])
    return max(1, len(dense_rank(cpus[cpus >= 0])[0]))


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
    gpu_idle_threshold: float = GPU_IDLE_THRESHOLD,
    window: Window | tuple[float | None, float | None] | str | None = None,
) -> Analysis:
    """Run every analyzer over a loaded trace (trainbpf.tracefile.Trace).  `window`: a
    Window (a (start_s, end_s) pair or "START:END" text is taken too)."""
    meta = dict(trace.meta or {})
    span = trace_span(meta, trace.chunks(["ts_ns", "dur_ns"]))
    win = resolve_window(span, Window.of(window))
    frame, view = trace.frame, trace.view

    # Off-CPU intervals are most of a trace: their columns the analysis uses, read once
    # and let go (the frame is a view of Arrow's memory) once they are slots.
    stack_rows = view("stack")
    pystacks = python_stacks(stack_rows)
    offcpu = frame("offcpu", OFFCPU_COLUMNS + (PYTHON_ID_COLUMNS if len(pystacks) else ()))
    offcpu_cpu = as_int64(offcpu["cpu"]).astype(np.int32)  # a copy: the frame goes
    seen = _seen([offcpu] + [frame(kind) for kind in THREAD_KINDS if kind != "offcpu"])
    base = observed_threads(view("thread"), frame("exit"), seen, span=span)
    recorded = meta.get("trainer_tid")  # the recorder was told which thread trains
    if trainer_tid is None and recorded is not None and int(recorded) in set(base["tid"].tolist()):
        trainer = int(recorded)
    else:
        trainer = pick_trainer(base, target_pid=meta.get("target_pid"), trainer_tid=trainer_tid)
    slots = state_slots(offcpu, frame("offcpu_short"), base)
    del offcpu
    release_unused_memory()
    stacks = classify_stacks(stack_rows)
    evidence_kinds = ("futex", "futex_addr", "mmap_lock", "reclaim", "compaction", "dirty_pause", "block_rq")
    frames = {kind: view(kind) for kind in evidence_kinds}
    slots, futex_waits = attribute_states(slots, frames, stacks)
    # The trainer's intervals (its slots are a slice: slots are sorted by tid), positions
    # of which identify its waits from here on.
    at = np.searchsorted(slots["tid"].to_numpy(), [trainer, trainer + 1]) if trainer is not None else (0, 0)
    trainer_states = expand_slots(slots.iloc[at[0]:at[1]])
    followed = is_followed(codes(trainer_states["state"]), codes(trainer_states["futex_class"]),
                           trainer_states["waker_tid"].to_numpy(np.int64))
    threads = assign_roles(
        base, trainer=trainer, named_by_user=trainer_tid is not None,
        trainer_wakers=_wake_counts(trainer_states, followed, trainer),
        writer_tids=np.unique(as_int64(frame("dirty_pause")["tid"])),
    )
    oncpu = frame("oncpu", ONCPU_COLUMNS + (("pystack_id",) if len(pystacks) else ()))
    oncpu["host"], oncpu["host_frame"] = host_labels(oncpu, stacks, pystacks)
    samples = sample_classes(oncpu, stacks)
    del oncpu
    run_split = RunSplit(samples, exact={kind: frames[kind] for kind, _ in EXACT_RUN_KINDS})
    totals = state_totals(slots, win)

    util = gpu_utilisation(view("gpu"), span, uuids=job_gpus(meta), pids=frozenset(int(p) for p in base["pid"].unique()))
    windows = sample_windows(util, win)
    if len(windows):
        basis = "gpu_idle"
        idle = idle_stretches(util, threshold=float(gpu_idle_threshold), window=win)
        gpu_idle = idle_fraction(util, win)
    else:
        basis = "trainer_not_running"
        windows = whole_window(win)
        idle = windows[["start_ns", "end_ns"]].copy()
        gpu_idle = None

    # With the CUDA probe's rows, the trainer's GPU waits are known exactly: cut its states
    # at them (time inside one is GPU-bound, not starved; docs/findings.md).
    cuda = timeline(view("cuda_call"), view("cuda_launch"), window=win)
    if cuda is None:  # no CUDA rows: the estimator's frames are empty
        cuda_waits, launches, launch_gap_rows = gpu_waits(view("cuda_call")), launch_bursts(view("cuda_launch")), None
    else:
        cuda_waits, launches, launch_gap_rows = cuda.of(trainer)
    uses_cuda = bool(len(cuda_waits) or len(launches))
    stall_states = split_at_waits(trainer_states, cuda_waits) if uses_cuda else trainer_states
    step_rows = steps(cuda_waits, launches, window=win)
    pieces, gpu_windows = starved_pieces(stall_states, windows, run_split, trainer, budget=basis == "gpu_idle",
                                         gaps=launch_gap_rows, host_split=HostSplit(samples))
    # Only the waits that starved the GPU are followed.
    stalled = pieces.loc[pieces["run_class"] == "", "interval"].unique()
    waits = followed_waits(trainer_states, stalled[followed[stalled]])
    pipeline = threads.loc[threads["role"].isin(PIPELINE_ROLES), "tid"].to_numpy(np.int64)
    chains, chain_ends = wait_chains(
        waits, slots, run_split, pipeline_tids=tuple(int(t) for t in pipeline),
        n_cpus=cpus_used(offcpu_cpu=offcpu_cpu, samples=samples),
    )

    churn = churn_threads(view("mm_syscall"), view("faults"), win)
    topology = meta.get("topology") or {}
    placement = thread_placement(samples[(samples["ts_ns"] >= win.start_ns) & (samples["ts_ns"] < win.end_ns)],
                                 view("numa_move"), topology)
    starved = attribute_starved(pieces, trainer_states, chain_ends, trainer_tid=trainer, churn=churn, placement=placement)
    ctx = EvidenceContext(
        window=win, threads=threads, slots=slots, trainer_states=trainer_states,
        futex_waits=futex_waits, stacks=stacks, frames={**frames, "faults": view("faults"), "mm_syscall": view("mm_syscall")},
        churn=churn, placement=placement, memory_nodes=memory_placement(view("numa_maps"), topology),
        gpu_node=gpu_node(topology), pystacks=pystacks, samples=samples,
    )
    findings = build_findings(starved, chains, chain_ends, ctx, trainer_tid=trainer,
                              gaps=launch_gap_rows)
    return Analysis(
        path=display_path(getattr(trace, "path", "")), meta=meta, span=span, window=win, trainer_tid=trainer,
        gpu_idle_threshold=float(gpu_idle_threshold), basis=basis, threads=threads, slots=slots, totals=totals,
        futex_waits=futex_waits, samples=samples, gpu=util, idle=idle, gpu_windows=gpu_windows, starved=starved, chains=chains, chain_ends=chain_ends,
        churn=churn, placement=placement, findings=findings, lost=lost_counts(meta, view("lost")),
        idle_fraction=gpu_idle, uses_cuda=uses_cuda, cuda_steps=step_summary(step_rows) if len(step_rows) else None,
        cuda=cuda, pystacks=pystacks,
    )


def observed_ns(analysis: Analysis) -> pd.Series:
    """Per tid, how long the thread was observed inside the window."""
    th = analysis.threads
    lo = np.maximum(th["first_ns"].to_numpy(), analysis.window.start_ns)
    hi = np.minimum(th["last_ns"].to_numpy(), analysis.window.end_ns)
    return pd.Series(np.maximum(hi - lo, 0), index=th["tid"].to_numpy())
