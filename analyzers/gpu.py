"""The GPU-starvation timeline: when the GPU sat idle and what the trainer was doing then.

A GPU sample reports utilisation over the period since the previous sample (how
nvidia-smi's utilization.gpu is defined), so sample i covers [ts[i-1], ts[i]).  Samples
below the idle threshold make idle windows.  Only the GPUs the traced processes held a
context on count, where the recorder saw which (metadata gpu.processes): on a shared
node the other jobs' GPUs say nothing about this one.  Starved time is the trainer's stalled time
inside them: not running, or running in the kernel's fault/reclaim/mapping paths.  With
no GPU samples the whole analysed window counts, i.e. starved time is the trainer's
non-running time.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.attribution import RunSplit
from trainbpf.analyzers.categories import RUN_CLASS_DTYPE, RUN_CLASSES, STATE_CODE, STATE_DTYPE, codes
from trainbpf.analyzers.intervals import Span, as_int64, intersect, merge_intervals

DEFAULT_SAMPLE_PERIOD_NS = 100_000_000  # nvidia-smi -lms 100
UTIL_COLUMNS = ("ts_ns", "start_ns", "util", "gpus")
WINDOW_COLUMNS = ("start_ns", "end_ns")
PIECE_COLUMNS = ("interval", "start_ns", "end_ns", "ns", "state", "run_class")


def job_gpus(meta: Mapping[str, Any]) -> frozenset[str]:
    """The uuids of the GPUs the traced processes held a context on (empty: not known)."""
    processes = ((meta.get("gpu") or {}).get("processes")) or []
    return frozenset(str(p["uuid"]) for p in processes if isinstance(p, Mapping) and p.get("uuid"))


def gpu_utilisation(gpu: pd.DataFrame, span: Span, *, uuids: frozenset[str] = frozenset()) -> pd.DataFrame:
    """One row per sampling sweep: the mean utilisation over the GPUs sampled at that
    time and the stretch [start_ns, ts_ns) it covers, clipped to the trace.  With
    `uuids`, only those GPUs' samples count (all of them if none of the samples match)."""
    if uuids and len(gpu) and "name" in gpu:
        mine = gpu["name"].astype(object).isin(uuids).to_numpy()
        if mine.any():
            gpu = gpu[mine]
    if not len(gpu):
        return pd.DataFrame(
            {"ts_ns": np.zeros(0, np.int64), "start_ns": np.zeros(0, np.int64),
             "util": np.zeros(0, np.float64), "gpus": np.zeros(0, np.int64)}
        )
    df = pd.DataFrame({"ts_ns": as_int64(gpu["ts_ns"]), "util": pd.to_numeric(gpu["value"], errors="coerce")})
    df = df[df["util"].notna()]
    sweeps = df.groupby("ts_ns", sort=True)["util"].agg(["mean", "size"]).reset_index()
    ts = sweeps["ts_ns"].to_numpy(np.int64)
    step = np.diff(ts)
    period = int(np.median(step)) if len(step) else DEFAULT_SAMPLE_PERIOD_NS
    start = np.concatenate([[ts[0] - period], ts[:-1]]) if len(ts) else ts
    start = np.clip(start, span.start_ns, span.end_ns)
    end = np.clip(ts, span.start_ns, span.end_ns)
    return pd.DataFrame(
        {"ts_ns": end, "start_ns": start, "util": sweeps["mean"].to_numpy(np.float64),
         "gpus": sweeps["size"].to_numpy(np.int64)}
    )[list(UTIL_COLUMNS)]


def idle_windows(util: pd.DataFrame, *, threshold: float, window: Span) -> pd.DataFrame:
    """Merged stretches inside `window` where utilisation was below `threshold` percent."""
    idle = util[util["util"] < threshold]
    start = np.clip(idle["start_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    end = np.clip(idle["ts_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    start, end = merge_intervals(start, end)
    return pd.DataFrame({"start_ns": start, "end_ns": end})[list(WINDOW_COLUMNS)]


def covered_window_ns(util: pd.DataFrame, window: Span) -> int:
    """How much of `window` the GPU samples cover (the idle fraction's denominator)."""
    start = np.clip(util["start_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    end = np.clip(util["ts_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    start, end = merge_intervals(start, end)
    return int((end - start).sum())


def starved_pieces(
    trainer_states: pd.DataFrame, windows: pd.DataFrame, run_split: RunSplit, trainer_tid: int | None
) -> pd.DataFrame:
    """The trainer's stalled time inside `windows`: one piece per (state interval, window)
    overlap; running overlaps become one piece per non-user RUN_CLASS, weighted by the
    on-CPU samples (`ns` is float ns)."""
    s = trainer_states["start_ns"].to_numpy(np.int64)
    e = trainer_states["end_ns"].to_numpy(np.int64)
    ia, _, ps, pe = intersect(s, e, windows["start_ns"].to_numpy(np.int64), windows["end_ns"].to_numpy(np.int64))
    state = codes(trainer_states["state"])[ia]
    running = state == STATE_CODE["running"]
    pieces = pd.DataFrame(
        {"interval": ia.astype(np.int64), "start_ns": ps, "end_ns": pe, "ns": (pe - ps).astype(np.float64),
         "state": pd.Categorical.from_codes(state, dtype=STATE_DTYPE),
         "run_class": pd.Categorical.from_codes(np.zeros(len(ia), np.int8), dtype=RUN_CLASS_DTYPE)}
    )
    stalled = pieces[~running]
    parts = [stalled]
    if running.any() and trainer_tid is not None:
        run = pieces[running]
        frac = run_split.fractions(trainer_tid, run["start_ns"].to_numpy(), run["end_ns"].to_numpy())
        for k, cls in enumerate(RUN_CLASSES):
            if cls == "user":
                continue
            share = frac[:, k]
            hit = share > 0
            if hit.any():
                part = run[hit].copy()
                part["ns"] = part["ns"].to_numpy() * share[hit]
                part["run_class"] = pd.Categorical([cls] * int(hit.sum()), dtype=RUN_CLASS_DTYPE)
                parts.append(part)
    out = pd.concat(parts, ignore_index=True) if len(parts) > 1 else stalled.reset_index(drop=True)
    return out[list(PIECE_COLUMNS)].sort_values(["start_ns", "run_class"], kind="stable").reset_index(drop=True)
