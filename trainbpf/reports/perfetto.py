"""Export a trace as Chrome trace-event JSON, which ui.perfetto.dev and chrome://tracing open.

One track per thread with its states as complete ("X") slices, a GPU utilisation counter
("C"), one track per finding category with the starved time it explains, flow arrows
("s" -> "f") from each waker to the wait it ended, and for each thread that made CUDA
calls two tracks: its GPU waits (synchronisations, blocking copies) and launch gaps, and
its launch bursts (a slice per burst, `args.launches` the count).  For a job of several
ranks each rank's process is named "rank R (pid P)" and holds, beside its threads, a
track of its collectives (a slice per collective from its arrival to its exit, `args`:
the rank that arrived last, by how many ms, and whether this rank waited) and its own
starved time by category, instead of the GPU process's starved tracks.  A state slice with a
Python stack (a trace recorded with the Python walk) carries it in `args.python` (the
thread's frames at the switch-out, leaf first, "qualname (file:line)") and
`args.waker_python` (the waker's at the wake-up).  Timestamps are
microseconds from the trace start.  Events are serialised column-wise with pandas, not
one dict per event.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import CATEGORIES
from trainbpf.analyzers.job.join import JobResult
from trainbpf.analyzers.pipeline import Analysis, analyze
from trainbpf.trace.memory import read_for_analysis
from trainbpf.trace.safefile import OutputFile, check_output, write_new

GPU_PID = 0  # a pseudo-process holding the GPU counter and (but for a job) the starved-time tracks
STARVED_TID_BASE = 1000
CUDA_TID_BASE = 2000  # CUDA thread i: waits and gaps on CUDA_TID_BASE + 2i, launches on + 2i + 1
# A rank's own tracks in its process: its collectives, then its starved time per category.
# Above any kernel tid (pid_max is at most 2**22), so no thread's track is taken.
RANK_TID_BASE = 1 << 30


def _us(ns: np.ndarray, origin: int) -> np.ndarray:
    return (np.asarray(ns, dtype=np.int64) - origin) / 1000.0


def _records(df: pd.DataFrame) -> str:
    """The frame's rows as comma-separated JSON objects (no brackets)."""
    if not len(df):
        return ""
    return df.to_json(orient="records", double_precision=15)[1:-1]


def trace_events(analysis: Analysis) -> list[str]:
    """Chunks of comma-separated trace events (each chunk a valid JSON list body)."""
    origin = analysis.span.start_ns
    threads = analysis.threads
    pid_of = pd.Series(threads["pid"].to_numpy(np.int64), index=threads["tid"].to_numpy(np.int64))
    meta = _process_meta(analysis)
    cuda_rows = analysis.cuda.threads if analysis.cuda is not None else pd.DataFrame({"tid": []})
    comm = dict(zip(threads["tid"].tolist(), threads["comm"].tolist()))
    for i, tid in enumerate(cuda_rows["tid"].tolist()):
        for j, what in enumerate(("CUDA waits", "CUDA launches")):
            track = CUDA_TID_BASE + 2 * i + j
            meta.append({"name": "thread_name", "ph": "M", "pid": GPU_PID, "tid": track,
                         "args": {"name": f"{what}: {comm.get(tid) or '?'} ({tid})"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": GPU_PID, "tid": track,
                         "args": {"sort_index": track}})
    chunks = [json.dumps(meta)[1:-1]]
    chunks += _cuda_events(analysis, cuda_rows["tid"].to_numpy(np.int64), origin)

    st = analysis.states
    tids = st["tid"].to_numpy(np.int64)
    slices = pd.DataFrame({
        "name": st["state"].astype(str).to_numpy(dtype=object), "cat": "state", "ph": "X",
        "ts": _us(st["start_ns"].to_numpy(), origin),
        "dur": (st["end_ns"].to_numpy() - st["start_ns"].to_numpy()) / 1000.0,
        "pid": pid_of.reindex(tids).fillna(-1).to_numpy(np.int64), "tid": tids,
    })
    python = _python_args(analysis, st)
    if python is None:
        chunks.append(_records(slices))
    else:  # only the slices that have a Python stack carry args
        rows, args = python
        chunks.append(_records(slices.drop(index=rows)))
        chunks.append(_records(slices.loc[rows].assign(args=args)))

    g = analysis.gpu
    if len(g):
        # One counter per GPU; a sample's value holds from its period's start.
        counters = pd.DataFrame({
            "name": "GPU utilisation % " + g["gpu"].astype(str), "ph": "C", "ts": _us(g["start_ns"].to_numpy(), origin),
            "pid": GPU_PID, "tid": 0, "args": [{"util": float(u)} for u in g["util"].to_numpy()],
        })
        chunks.append(_records(counters))

    chunks += [_starved_events(analysis, origin), _collective_events(analysis, origin)]

    # Wake-ups: from the waker (running at the wake-up) to the blocked slice it ended.
    blocked = ~st["state"].isin(["running", "runnable"]).to_numpy()
    waker = st["waker_tid"].to_numpy(np.int64)
    woken = blocked & (waker >= 0) & np.isin(waker, pid_of.index.to_numpy())
    if woken.any():
        at = _us(st["end_ns"].to_numpy()[woken], origin)
        ids = np.arange(int(woken.sum()))
        common = {"name": "wakeup", "cat": "wakeup", "id": ids, "ts": at}
        start = pd.DataFrame({**common, "ph": "s", "pid": pid_of.reindex(waker[woken]).to_numpy(np.int64), "tid": waker[woken]})
        # bp "e": bind to the slice that encloses the timestamp (the wakee's next state).
        finish = pd.DataFrame({**common, "ph": "f", "bp": "e", "pid": pid_of.reindex(tids[woken]).to_numpy(np.int64), "tid": tids[woken]})
        chunks += [_records(start), _records(finish)]
    return [c for c in chunks if c]


def _rank_of_pid(analysis: Analysis) -> dict[int, int]:
    """A job's rank processes: pid -> rank; empty for one process."""
    job = analysis.job
    return {} if job is None else dict(zip(job.ranks["pid"].tolist(), job.ranks["rank"].tolist()))


def _rank_pids(job: JobResult, ranks: pd.Series) -> np.ndarray:
    """The process of each rank in `ranks`."""
    return job.ranks.set_index("rank")["pid"].reindex(ranks.to_numpy(np.int64)).fillna(GPU_PID).to_numpy(np.int64)


def _process_meta(analysis: Analysis) -> list[dict[str, Any]]:
    """Names of the processes, their threads and the starved-time tracks (a rank's
    process: "rank R (pid P)", in rank order, with its collectives and starved tracks)."""
    threads, ranks = analysis.threads, _rank_of_pid(analysis)
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": GPU_PID, "tid": 0,
         "args": {"name": "GPU" if ranks else "GPU and starved time"}},
    ]
    for pid in sorted(set(threads["pid"].tolist())):
        comm = threads.loc[(threads["pid"] == pid) & (threads["tid"] == pid), "comm"]
        name = f"{comm.iloc[0]} ({pid})" if len(comm) else f"process {pid}"
        if pid in ranks:
            name = f"rank {ranks[pid]} (pid {pid})"
            meta.append({"name": "process_sort_index", "ph": "M", "pid": int(pid), "tid": 0,
                         "args": {"sort_index": ranks[pid]}})
        meta.append({"name": "process_name", "ph": "M", "pid": int(pid), "tid": 0, "args": {"name": name}})
    for th in threads.itertuples(index=False):
        meta.append({"name": "thread_name", "ph": "M", "pid": int(th.pid), "tid": int(th.tid),
                     "args": {"name": f"{th.comm or '?'} [{th.role}]"}})
        order = 0 if th.role == "trainer" else 1
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": int(th.pid), "tid": int(th.tid),
                     "args": {"sort_index": order}})
    owners = [(pid, RANK_TID_BASE + 1) for pid in ranks] or [(GPU_PID, STARVED_TID_BASE)]
    for pid, base in owners:
        if pid != GPU_PID:
            meta.append({"name": "thread_name", "ph": "M", "pid": int(pid), "tid": RANK_TID_BASE,
                         "args": {"name": "collectives"}})
        for i, cat in enumerate(CATEGORIES):
            meta.append({"name": "thread_name", "ph": "M", "pid": int(pid), "tid": base + i,
                         "args": {"name": f"starved: {cat}"}})
    return meta


def _starved_events(analysis: Analysis, origin: int) -> str:
    """The starved pieces on their category's track: the GPU process's, or for a job the
    track of the rank whose starved time each piece is."""
    sv = analysis.starved
    if not len(sv):
        return ""
    codes = sv["category"].cat.codes.to_numpy(np.int64)
    if analysis.job is None:
        pid, tid = GPU_PID, STARVED_TID_BASE + codes
    else:
        pid = _rank_pids(analysis.job, sv["rank"])
        tid = RANK_TID_BASE + 1 + codes
    return _records(pd.DataFrame({
        "name": sv["category"].astype(str).to_numpy(dtype=object), "cat": "starved", "ph": "X",
        "ts": _us(sv["start_ns"].to_numpy(), origin), "dur": (sv["end_ns"] - sv["start_ns"]).to_numpy() / 1000.0,
        "pid": pid, "tid": tid,
    }))


def _collective_events(analysis: Analysis, origin: int) -> str:
    """A job's collectives: per rank a slice from its arrival to its exit, named by the
    collective's number, its args the rank that arrived last, its lead in ms and whether
    this rank waited."""
    job = analysis.job
    if job is None or not len(job.arrivals):
        return ""
    arrivals = job.arrivals.merge(job.last[["collective", "last_rank", "lead_ns"]], on="collective", how="left")
    pid = _rank_pids(job, arrivals["rank"])
    return _records(pd.DataFrame({
        "name": "collective " + arrivals["collective"].astype(str), "cat": "collective", "ph": "X",
        "ts": _us(arrivals["arrive_ns"].to_numpy(), origin),
        "dur": (arrivals["exit_ns"] - arrivals["arrive_ns"]).to_numpy() / 1000.0, "pid": pid, "tid": RANK_TID_BASE,
        "args": [{"last_rank": int(r), "lead_ms": round(float(lead) / 1e6, 3), "waited": bool(w)}
                 for r, lead, w in zip(arrivals["last_rank"].fillna(-1), arrivals["lead_ns"].fillna(0), arrivals["waited"])],
    }))


def _python_args(analysis: Analysis, states: pd.DataFrame) -> tuple[np.ndarray, list[dict[str, Any]]] | None:
    """The state slices (rows of `states`) that have a Python stack, and their args; None
    when none has."""
    stacks = analysis.pystacks
    if stacks is None or not len(stacks):
        return None
    frames = dict(zip(stacks["stack_id"].tolist(), (str(f).split(";") for f in stacks["frames"])))
    own, waker = states["pystack_id"].to_numpy(np.int64), states["peer_pystack_id"].to_numpy(np.int64)
    rows = np.flatnonzero(np.isin(own, list(frames)) | np.isin(waker, list(frames)))
    if not len(rows):
        return None
    args = []
    for a, b in zip(own[rows].tolist(), waker[rows].tolist()):
        arg = {}
        if a in frames:
            arg["python"] = frames[a]
        if b in frames:
            arg["waker_python"] = frames[b]
        args.append(arg)
    return rows, args


def _cuda_events(analysis: Analysis, tids: np.ndarray, origin: int) -> list[str]:
    """The CUDA tracks' slices: per thread (track index = position in `tids`) its GPU
    waits named by call and its launch gaps on one track, its launch bursts on the next."""
    if analysis.cuda is None or not len(tids):
        return []
    cuda = analysis.cuda
    track = pd.Series(CUDA_TID_BASE + 2 * np.arange(len(tids)), index=tids)

    def slices(frame: pd.DataFrame, name: Any, cat: str, lane: int, **args: Any) -> str:
        frame = frame[np.isin(frame["tid"].to_numpy(np.int64), tids)]
        start, end = frame["start_ns"].to_numpy(np.int64), frame["end_ns"].to_numpy(np.int64)
        out = pd.DataFrame({
            "name": name(frame) if callable(name) else name, "cat": cat, "ph": "X", "ts": _us(start, origin),
            "dur": (end - start) / 1000.0, "pid": GPU_PID,
            "tid": track.reindex(frame["tid"].to_numpy(np.int64)).to_numpy(np.int64) + lane,
        })
        for key, column in args.items():
            out["args"] = [{key: int(v)} for v in frame[column].to_numpy(np.int64)]
        return _records(out)

    gaps = cuda.gaps[cuda.gaps["gap_ns"].to_numpy(np.int64) > 0]
    return [c for c in (
        slices(cuda.waits, lambda f: f["name"].astype(str).to_numpy(dtype=object), "cuda_wait", 0),
        slices(gaps, "launch gap", "cuda_gap", 0),
        slices(cuda.bursts, "launches", "cuda_launch", 1, launches="launches"),
    ) if c]


def write_trace_events(analysis: Analysis, output: str | os.PathLike | OutputFile, *, force: bool = False) -> Path:
    def write(fh) -> None:
        fh.write(b'{"displayTimeUnit":"ms","traceEvents":[')
        fh.write(",\n".join(trace_events(analysis)).encode("utf-8"))
        fh.write(b"]}\n")

    return write_new(output, write, force=force)


def run_export(*, path: str | os.PathLike, output: str | os.PathLike, force: bool = False,
               memory_check: bool = True) -> Path:
    """Read a trace, analyse it and write the Chrome/Perfetto JSON to `output` (an
    existing file only with `force`); a trace too large for the memory available is
    refused unless `memory_check` is off."""
    with check_output(output, force=force) as out:  # before the analysis; written into the folder checked then
        return write_trace_events(analyze(read_for_analysis(path, memory_check=memory_check)), out)
