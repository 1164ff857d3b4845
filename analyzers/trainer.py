"""One trainer's analysis and what every trainer of a trace shares: `share` reads and
attributes the trace's threads, states and samples once; `trainer_part` finds one
trainer's starved pieces against its GPU, follows their wake-up chains and names their
categories (docs/design.md §Attribution model, §Starvation estimator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.analyzers.causes.attribution import (
    EXACT_RUN_KINDS,
    RunSplit,
    attribute_states,
    churn_threads,
    sample_classes,
)
from trainbpf.analyzers.causes.chains import followed_waits, is_followed, wait_chains
from trainbpf.analyzers.causes.evidence import EvidenceContext
from trainbpf.analyzers.causes.host import HostSplit, host_labels
from trainbpf.analyzers.causes.huge_pages import process_pages, thp_state
from trainbpf.analyzers.causes.io_culprits import IO_KINDS
from trainbpf.analyzers.causes.held_frees import held_frees
from trainbpf.analyzers.causes.lifetimes import buffers, busy_period_starts, freed_by_others, lifetimes
from trainbpf.analyzers.causes.network import NET_KINDS
from trainbpf.analyzers.causes.numa import copy_sources, gpu_node, memory_placement, thread_placement
from trainbpf.analyzers.causes.stack_reading import classify_stacks, python_stacks
from trainbpf.analyzers.causes.tlb import mm_call_counts, shootdown_charges
from trainbpf.analyzers.findings.ranking import attribute_starved
from trainbpf.analyzers.intervals import Span, as_int64, dense_rank, resolve_window, trace_span
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.threads.roles import assign_roles, observed_threads
from trainbpf.analyzers.threads.states import PYTHON_ID_COLUMNS, expand_slots, state_slots
from trainbpf.analyzers.timeline.cuda_calls import (
    CudaTimeline,
    gpu_waits,
    launch_bursts,
    split_at_waits,
    steps,
    timeline,
)
from trainbpf.analyzers.timeline.starvation import (
    gpu_utilisation,
    idle_fraction,
    job_gpus,
    sample_windows,
    starved_pieces,
    whole_window,
)
from trainbpf.analyzers.vocab import codes
from trainbpf.trace.reader import release_unused_memory
from trainbpf.trace.schema import KIND_COLUMNS, MACHINE_WIDE_KINDS


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


def _wake_counts(trainer_states: pd.DataFrame, followed: np.ndarray, trainer: int | None) -> pd.Series:
    """Per waker tid, how many of the trainer's followed waits (not lock handoffs) it ended."""
    wakers = trainer_states["waker_tid"].to_numpy(np.int64)[followed]
    return pd.Series(wakers[wakers != trainer]).value_counts()


# The offcpu columns the analyzers read.
OFFCPU_COLUMNS = ("ts_ns", "dur_ns", "tid", "pid", "cpu", "state", "runq_ns", "peer_tid", "kstack_id", "ustack_id")
# The oncpu columns the analyzers read.  Python stack ids (offcpu: states.PYTHON_ID_COLUMNS,
# oncpu: pystack_id) are read only from a trace that holds Python stacks.
ONCPU_COLUMNS = ("ts_ns", "tid", "pid", "cpu", "kstack_id", "ustack_id")
# The kinds whose rows name a traced thread: every one of them shows when a thread was seen.
THREAD_KINDS = tuple(kind for kind, columns in KIND_COLUMNS.items() if "tid" in columns and kind not in MACHINE_WIDE_KINDS)
# Threads whose CPU use is the input pipeline's own.
PIPELINE_ROLES = ("trainer", "dataloader", "pin_memory")


def cpus_used(*, offcpu_cpu: np.ndarray, samples: pd.DataFrame) -> int:
    """How many CPUs the traced threads ran on (switch-in CPUs and sample CPUs)."""
    cpus = np.concatenate([as_int64(offcpu_cpu), samples["cpu"].to_numpy(np.int64)])
    return max(1, len(dense_rank(cpus[cpus >= 0])[0]))


@dataclass
class Shared:
    """What every trainer's analysis shares: the trace's threads, states and samples,
    and the GPU's sample windows."""

    trace: Any
    meta: dict[str, Any]
    span: Span
    win: Span
    base: pd.DataFrame  # observed_threads: no roles yet
    slots: pd.DataFrame
    futex_waits: pd.DataFrame
    stacks: pd.DataFrame
    pystacks: pd.DataFrame
    frames: dict[str, pd.DataFrame]  # the evidence kinds
    samples: pd.DataFrame
    run_split: RunSplit
    n_cpus: int
    cuda: CudaTimeline | None
    churn: pd.DataFrame
    placement: pd.DataFrame
    pages: pd.DataFrame  # huge_pages.PAGE_COLUMNS: each process's faults per MiB newly mapped
    thp: dict[str, Any]  # huge_pages.thp_state
    shootdowns: pd.DataFrame  # tlb.CHARGE_COLUMNS: TLB shootdowns each thread received, by sender
    mm_calls: pd.DataFrame  # tlb.CALL_COLUMNS: each thread's mm syscalls in the window
    buffers: pd.DataFrame  # lifetimes.BUFFER_COLUMNS: every mapping paired with its unmapping

    def trainer_states(self, trainer: int | None) -> tuple[pd.DataFrame, np.ndarray]:
        """A trainer's state intervals (its slots are a slice: slots are sorted by tid),
        whose positions identify its waits from here on, and which of them are followed."""
        slots = self.slots
        at = np.searchsorted(slots["tid"].to_numpy(), [trainer, trainer + 1]) if trainer is not None else (0, 0)
        states = expand_slots(slots.iloc[at[0]:at[1]])
        followed = is_followed(codes(states["state"]), codes(states["futex_class"]), states["waker_tid"].to_numpy(np.int64))
        return states, followed

    def gpu(self, pids: frozenset[int]) -> tuple[str, pd.DataFrame, pd.DataFrame, float | None]:
        """(basis, utilisation, sample windows, idle fraction) of the GPUs the processes
        `pids` used; the whole window as one idle 'sample' without samples."""
        util = gpu_utilisation(self.trace.view("gpu"), self.span, uuids=job_gpus(self.meta), pids=pids)
        windows = sample_windows(util, self.win)
        if len(windows):
            return "gpu_idle", util, windows, idle_fraction(util, self.win)
        return "trainer_not_running", util, whole_window(self.win), None


def share(trace: Any, window: Window | None) -> Shared:
    """Threads, attributed states, samples: read and computed once for every trainer."""
    meta = dict(trace.meta or {})
    span = trace_span(meta, trace.chunks(["ts_ns", "dur_ns"]))
    win = resolve_window(span, window)
    frame, view = trace.frame, trace.view
    # Off-CPU intervals are most of a trace: their columns the analysis uses, read once
    # and let go (the frame is a view of Arrow's memory) once they are slots.
    stack_rows = view("stack")
    pystacks = python_stacks(stack_rows)
    offcpu = frame("offcpu", OFFCPU_COLUMNS + (PYTHON_ID_COLUMNS if len(pystacks) else ()))
    offcpu_cpu = as_int64(offcpu["cpu"]).astype(np.int32)  # a copy: the frame goes
    seen = _seen([offcpu] + [frame(kind) for kind in THREAD_KINDS if kind != "offcpu"])
    base = observed_threads(view("thread"), frame("exit"), seen, span=span)
    slots = state_slots(offcpu, frame("offcpu_short"), base)
    del offcpu
    release_unused_memory()
    stacks = classify_stacks(stack_rows)
    evidence_kinds = ("futex", "futex_addr", "mmap_lock", "reclaim", "compaction", "dirty_pause", "block_rq", "net_io", "socket")
    frames = {kind: view(kind) for kind in evidence_kinds}
    slots, futex_waits = attribute_states(slots, frames, stacks)
    oncpu = frame("oncpu", ONCPU_COLUMNS + (("pystack_id",) if len(pystacks) else ()))
    oncpu["host"], oncpu["host_frame"] = host_labels(oncpu, stacks, pystacks)
    samples = sample_classes(oncpu, stacks)
    del oncpu
    run_split = RunSplit(samples, exact={kind: frames[kind] for kind, _ in EXACT_RUN_KINDS})
    bufs = buffers(view("mm_syscall"), view("cuda_call"))
    # A thread's mappings that another unmapped are given back too (a loader's batches the trainer frees).
    churn = churn_threads(view("mm_syscall"), view("faults"), win, freed_by_others(bufs, win))
    placement = thread_placement(samples[(samples["ts_ns"] >= win.start_ns) & (samples["ts_ns"] < win.end_ns)],
                                 view("numa_move"), meta.get("topology") or {})
    return Shared(
        trace=trace, meta=meta, span=span, win=win, base=base, slots=slots, futex_waits=futex_waits, stacks=stacks,
        pystacks=pystacks, frames=frames, samples=samples, run_split=run_split,
        n_cpus=cpus_used(offcpu_cpu=offcpu_cpu, samples=samples),
        cuda=timeline(view("cuda_call"), view("cuda_launch"), window=win), churn=churn, placement=placement,
        pages=process_pages(view("mm_syscall"), view("faults"), win), thp=thp_state(meta, view("vmstat"), win),
        shootdowns=shootdown_charges(view("tlb_flush"), win), mm_calls=mm_call_counts(view("mm_syscall"), win), buffers=bufs)


@dataclass
class TrainerPart:
    """One trainer's analysis: its states, starved pieces and their chains.  `timeline`
    (a job's ranks only) is every piece of its time, host work counted and nothing
    budgeted: what it was doing while other ranks waited for it."""

    trainer: int | None
    states: pd.DataFrame
    gpu_windows: pd.DataFrame
    starved: pd.DataFrame  # findings.ATTRIBUTED_COLUMNS
    chains: pd.DataFrame
    chain_ends: pd.DataFrame
    ctx: EvidenceContext
    uses_cuda: bool
    step_rows: pd.DataFrame
    gaps: pd.DataFrame | None
    timeline: pd.DataFrame | None = None


def trainer_part(sh: Shared, threads: pd.DataFrame, trainer: int | None, states: pd.DataFrame, followed: np.ndarray,
                 *, basis: str, windows: pd.DataFrame, with_timeline: bool = False) -> TrainerPart:
    """Starved pieces of one trainer against its GPU's `windows`, their wake-up chains
    and their categories."""
    win = sh.win
    # With the CUDA probe's rows, the trainer's GPU waits are known exactly: cut its states
    # at them (time inside one is GPU-bound, not starved; docs/findings.md).
    if sh.cuda is None:  # no CUDA rows: the estimator's frames are empty
        view = sh.trace.view
        cuda_waits, launches, gaps = gpu_waits(view("cuda_call")), launch_bursts(view("cuda_launch")), None
    else:
        cuda_waits, launches, gaps = sh.cuda.of(trainer)
    uses_cuda = bool(len(cuda_waits) or len(launches))
    stall_states = split_at_waits(states, cuda_waits) if uses_cuda else states
    host_split = HostSplit(sh.samples)
    pieces, gpu_windows = starved_pieces(stall_states, windows, sh.run_split, trainer, budget=basis == "gpu_idle",
                                         gaps=gaps, host_split=host_split)
    every = None
    if with_timeline:
        every, _ = starved_pieces(stall_states, whole_window(win), sh.run_split, trainer, budget=False, gaps=gaps,
                                  host_split=host_split, count_host=True)
    # Only the waits that starved the GPU (or, in a job, that took any time) are followed.
    stalled = (every if every is not None else pieces)
    stalled = stalled.loc[stalled["run_class"] == "", "interval"].unique()
    waits = followed_waits(states, stalled[followed[stalled]])
    pipeline = threads.loc[threads["role"].isin(PIPELINE_ROLES), "tid"].to_numpy(np.int64)
    chains, chain_ends = wait_chains(waits, sh.slots, sh.run_split, pipeline_tids=tuple(int(t) for t in pipeline),
                                     n_cpus=sh.n_cpus)

    def attribute(p: pd.DataFrame) -> pd.DataFrame:
        return attribute_starved(p, states, chain_ends, trainer_tid=trainer, churn=sh.churn, placement=sh.placement)

    topology = sh.meta.get("topology") or {}
    step_rows = steps(cuda_waits, launches, window=win)
    # Lifetimes in the trainer's steps where its CUDA calls show them, else in the GPU's
    # busy periods, else in seconds.
    step_starts = step_rows["start_ns"].to_numpy(np.int64) if len(step_rows) else busy_period_starts(windows)
    buffer_lifetimes = lifetimes(sh.buffers, sh.trace.view("faults"), step_starts, win)
    ctx = EvidenceContext(
        window=win, threads=threads, slots=sh.slots, trainer_states=states, futex_waits=sh.futex_waits,
        stacks=sh.stacks, frames={**sh.frames, **{k: sh.trace.view(k) for k in ("faults", "mm_syscall", "preempted_by") + IO_KINDS + NET_KINDS}},
        churn=sh.churn, placement=sh.placement, memory_nodes=memory_placement(sh.trace.view("numa_maps"), topology),
        gpu_node=gpu_node(topology), topology=topology, pystacks=sh.pystacks,
        copies=copy_sources(sh.trace.view("copy_node"), sh.trace.view("affinity"), sh.placement, topology,
                            win.start_ns, win.end_ns), samples=sh.samples, pages=sh.pages, thp=sh.thp,
        shootdowns=sh.shootdowns, mm_calls=sh.mm_calls, lifetimes=buffer_lifetimes,
        held_frees=held_frees(sh.trace.view("cuda_call"), win),
    )
    return TrainerPart(trainer=trainer, states=states, gpu_windows=gpu_windows, starved=attribute(pieces),
                       chains=chains, chain_ends=chain_ends, ctx=ctx, uses_cuda=uses_cuda,
                       step_rows=step_rows, gaps=gaps,
                       timeline=None if every is None else attribute(every))


def roles(sh: Shared, trainers: dict[int, tuple[pd.DataFrame, np.ndarray]], *, named_by_user: bool = False) -> pd.DataFrame:
    """Every thread's role, with `trainers` (tid -> its states and followed mask) the trainers."""
    wakers = [_wake_counts(states, followed, tid) for tid, (states, followed) in trainers.items()]
    counts = pd.concat(wakers).groupby(level=0).sum() if wakers else None
    return assign_roles(sh.base, trainer=list(trainers), named_by_user=named_by_user, trainer_wakers=counts,
                        writer_tids=np.unique(as_int64(sh.trace.frame("dirty_pause")["tid"])))
