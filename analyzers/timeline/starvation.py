"""The GPU-starvation timeline: how much of each GPU sample was idle, and which of the
trainer's stalls that idle time is put down to (docs/findings.md, "Starved time").

A GPU sample reports utilisation u averaged over a period p ending at its timestamp (the
sample's own `dur_ns` where the source says so: NVML's driver samples; else the time
since the previous sample of that GPU: nvidia-smi).  The sample holds (1 - u/100)·p of
idle time, wherever in the period it fell.  Inside that window the trainer's stalls and
its own host work can explain at most that much, the named stalls first:

    stalls(window) = min(idle, named stalls)
    host(window)   = min(idle - stalls, host work)
    starved(window) = stalls + host

each shared among its pieces in proportion to their length.  Host work is the trainer's
running time in user code outside GPU synchronisations (analyzers/causes/host.py: a spinning
sync is GPU-bound), split by its samples into data loading and other computation; with
CUDA rows only its running time inside the exact launch gaps.  Named stalls
are those with a cause: woken by a traced thread (followed to the producer), runnable,
fault/reclaim/mmap_lock/throttling/block I/O, a contended lock or the GIL, and running
time the on-CPU samples put in the kernel's fault or reclaim paths.  Sleeps that no
traced thread ended (a timer, an interrupt: what a blocking CUDA synchronisation looks
like from the kernel) are *not* a cause: while the trainer waits for the GPU the GPU is
busy.  The idle time left that they could cover is reported as such
(`unwoken_idle_ns`), never shared into findings.  Only the GPUs the traced processes use count (metadata gpu.processes);
with per-process samples (NVML), only the job's own share of a GPU counts.  Several GPUs
of one job: the model runs per GPU and each GPU weighs 1/G, so starved seconds are
GPU-averaged seconds and never exceed the trainer's stalled and host-working time.  With
no GPU samples the whole analysed window is one fully idle window without a budget:
starved time is the trainer's non-running time (and, with CUDA rows, its host work in
launch gaps).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.attribution import RunSplit
from trainbpf.analyzers.causes.categories import CATEGORY_CODE
from trainbpf.analyzers.causes.chains import interval_category_codes, is_followed
from trainbpf.analyzers.causes.host import HostSplit
from trainbpf.analyzers.intervals import Span, as_int64, intersect
from trainbpf.analyzers.timeline.cuda_calls import in_gaps_ns
from trainbpf.analyzers.vocab import (
    HOST_CLASSES,
    RUN_CLASS_DTYPE,
    RUN_CLASSES,
    STATE_CODE,
    STATE_DTYPE,
    codes,
)
from trainbpf.trace.schema import named_frame

DEFAULT_SAMPLE_PERIOD_NS = 100_000_000  # nvidia-smi -lms 100
# One row per GPU sample window: `gpu` names the GPU (uuid, else index), [start_ns, ts_ns)
# the period the sample describes, `util` the job's utilisation percent over it.
UTIL_COLUMNS = ("gpu", "start_ns", "ts_ns", "util")
# Per GPU sample window inside the analysed window: its idle ns, the stalls of the trainer
# inside it (named: with a cause; unwoken: sleeps no traced thread ended), the starved
# ns the named stalls explain, the idle ns unwoken sleeps overlap at most, and the GPU's
# weight (1/number of GPUs).
# gpu_bound_ns: the trainer's time inside CUDA waits (only with CUDA rows; never starved);
# host_ns its host work (user running time outside GPU synchronisations; with CUDA rows
# inside launch gaps only) and host_bound_ns the idle time that explains (part of starved_ns).
WINDOW_COLUMNS = ("gpu", "start_ns", "end_ns", "idle_ns", "named_ns", "unwoken_ns", "starved_ns", "unwoken_idle_ns",
                  "gpu_bound_ns", "host_ns", "host_bound_ns", "weight")
# What a piece of the trainer's time is to the estimator: a named stall, an unwoken sleep,
# GPU-bound (inside a CUDA wait), or host work.
NAMED, UNWOKEN, BOUND, HOST = 0, 1, 2, 3
PIECE_COLUMNS = ("interval", "start_ns", "end_ns", "ns", "state", "run_class")


def job_gpus(meta: Mapping[str, Any]) -> frozenset[str]:
    """The uuids of the GPUs the traced processes held a context on (empty: not known)."""
    processes = ((meta.get("gpu") or {}).get("processes")) or []
    return frozenset(str(p["uuid"]) for p in processes if isinstance(p, Mapping) and p.get("uuid"))


def _empty_util() -> pd.DataFrame:
    return pd.DataFrame({"gpu": pd.Series([], dtype=object), "start_ns": np.zeros(0, np.int64),
                         "ts_ns": np.zeros(0, np.int64), "util": np.zeros(0, np.float64)})


def _series_windows(ts: np.ndarray, dur: np.ndarray, util: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sample series (one GPU, or one process on it) as disjoint windows [start, end):
    a sample covers its own `dur` when known (> 0), else the time since the previous
    sample; the first sample without a period covers the series' median spacing."""
    order = np.argsort(ts, kind="stable")
    ts, dur, util = ts[order], dur[order], util[order]
    last = np.append(ts[1:] != ts[:-1], True)  # a repeated timestamp: the newest row wins
    ts, dur, util = ts[last], dur[last], util[last]
    step = np.diff(ts)
    period = int(np.median(step)) if len(step) else DEFAULT_SAMPLE_PERIOD_NS
    prev = np.concatenate([[ts[0] - period], ts[:-1]]) if len(ts) else ts
    start = np.where(dur > 0, ts - dur, prev)
    start = np.maximum(start, np.concatenate([[np.iinfo(np.int64).min], ts[:-1]]))  # never overlap the previous
    return start, ts, util


def _sum_series(series: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Several processes' utilisation of one GPU as one step function: the sum of their
    percentages (at most 100) over the pieces between all their window edges; time no
    series covers is left out."""
    if len(series) == 1:
        return series[0]
    edges = np.unique(np.concatenate([np.concatenate([s, e]) for s, e, _ in series]))
    lo, hi = edges[:-1], edges[1:]
    total = np.zeros(len(lo))
    covered = np.zeros(len(lo), bool)
    for start, end, util in series:
        at = np.searchsorted(end, lo, side="right")  # the window ending after the piece starts
        inside = at < len(end)
        inside[inside] &= start[at[inside]] <= lo[inside]
        total[inside] += util[at[inside]]
        covered |= inside
    return lo[covered], hi[covered], np.minimum(total[covered], 100.0)


def _gpu_keys(gpu: pd.DataFrame) -> np.ndarray:
    """Per gpu row (view names), the name its GPU's windows go by: its uuid, else "gpuN"."""
    index = "gpu" + pd.Series(as_int64(gpu["index"], 0), index=gpu.index).astype(str)
    key = gpu["uuid"].astype(object).where(gpu["uuid"].notna(), index) if "uuid" in gpu else index
    return key.to_numpy(dtype=object)


def gpu_names_by_index(gpu: pd.DataFrame) -> dict[int, str]:
    """Each GPU's window name (gpu_utilisation's `gpu`) by its index."""
    if not len(gpu):
        return {}
    gpu = named_frame("gpu", gpu)
    return dict(zip(as_int64(gpu["index"], 0).tolist(), _gpu_keys(gpu).tolist()))


def rank_gpu(windows: pd.DataFrame, *, local_rank: int, visible: str, names: dict[int, str]) -> pd.DataFrame:
    """The windows of a rank's own GPU, weighing 1, where several GPUs were sampled: the
    device cuda:LOCAL_RANK is, by CUDA_VISIBLE_DEVICES (`visible`: indices or UUIDs; one
    entry, that one) else the GPU of index LOCAL_RANK; `names`: gpu_names_by_index.  All
    the windows where none of that says which."""
    sampled = set(pd.unique(windows["gpu"]).tolist())
    if len(sampled) < 2:
        return windows
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    entry = (entries[local_rank] if 0 <= local_rank < len(entries) else entries[0] if len(entries) == 1 else None) \
        if entries else (str(local_rank) if local_rank >= 0 else None)
    name = names.get(int(entry)) if entry is not None and entry.isdigit() else entry
    if name not in sampled:
        return windows
    return windows[windows["gpu"] == name].assign(weight=1.0)


def gpu_utilisation(
    gpu: pd.DataFrame, span: Span, *, uuids: frozenset[str] = frozenset(), pids: frozenset[int] = frozenset()
) -> pd.DataFrame:
    """UTIL_COLUMNS: every GPU's sample windows, clipped to the trace, sorted by GPU and
    time.  With `uuids`, only those GPUs count (all of them if no sample matches).  A GPU
    with per-process samples (rows with a pid) of any of `pids` is measured by those
    processes' summed utilisation, not the device's.  `gpu`: the gpu rows, as Trace.view
    reads them (Trace.frame's storage names are taken too)."""
    if not len(gpu):
        return _empty_util()
    gpu = named_frame("gpu", gpu)
    key = _gpu_keys(gpu)
    if uuids:
        mine = np.isin(key, list(uuids))
        if mine.any():
            gpu, key = gpu[mine], key[mine]
    ts = as_int64(gpu["ts_ns"])
    dur = as_int64(gpu["dur_ns"], 0) if "dur_ns" in gpu else np.zeros(len(gpu), np.int64)
    pid = as_int64(gpu["pid"]) if "pid" in gpu else np.full(len(gpu), -1, np.int64)
    util = pd.to_numeric(gpu["util_pct"], errors="coerce").to_numpy(np.float64)
    ok = np.isfinite(util) & (ts > 0)
    util = np.clip(util, 0.0, 100.0)
    parts = []
    for name in pd.unique(key[ok]):
        rows = ok & (key == name)
        job = rows & (pid >= 0) & np.isin(pid, list(pids))
        if job.any():
            series = [_series_windows(ts[job & (pid == p)], dur[job & (pid == p)], util[job & (pid == p)])
                      for p in np.unique(pid[job])]
        else:
            device = rows & (pid < 0)
            if not device.any():
                continue
            series = [_series_windows(ts[device], dur[device], util[device])]
        start, end, value = _sum_series(series)
        start = np.clip(start, span.start_ns, span.end_ns)
        end = np.clip(end, span.start_ns, span.end_ns)
        keep = end > start
        parts.append(pd.DataFrame({"gpu": name, "start_ns": start[keep], "ts_ns": end[keep], "util": value[keep]}))
    if not parts:
        return _empty_util()
    return pd.concat(parts, ignore_index=True)[list(UTIL_COLUMNS)]


def idle_fraction(util: pd.DataFrame, window: Span) -> float | None:
    """The time-weighted idle share of the job's GPUs inside `window`: 1 - mean
    utilisation, each GPU weighing the same (None without samples there)."""
    w = sample_windows(util, window)
    covered = float(((w["end_ns"] - w["start_ns"]) * w["weight"]).sum())
    return float((w["idle_ns"] * w["weight"]).sum()) / covered if covered > 0 else None


def sample_windows(util: pd.DataFrame, window: Span) -> pd.DataFrame:
    """(gpu, start_ns, end_ns, idle_ns, weight): the sample windows clipped to `window`;
    a window cut by it keeps the idle time in proportion."""
    start = np.clip(util["start_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    end = np.clip(util["ts_ns"].to_numpy(np.int64), window.start_ns, window.end_ns)
    keep = end > start
    gpus = util["gpu"].to_numpy(dtype=object)[keep]
    n_gpus = max(1, len(pd.unique(gpus)))
    idle = (1.0 - util["util"].to_numpy(np.float64)[keep] / 100.0) * (end[keep] - start[keep])
    return pd.DataFrame({"gpu": gpus, "start_ns": start[keep], "end_ns": end[keep], "idle_ns": idle,
                         "weight": np.full(int(keep.sum()), 1.0 / n_gpus)})


def whole_window(window: Span) -> pd.DataFrame:
    """The analysed window as the one fully idle 'sample' used without GPU samples."""
    n = int(window.ns > 0)
    return pd.DataFrame({"gpu": np.array([""] * n, dtype=object), "start_ns": np.full(n, window.start_ns, np.int64),
                         "end_ns": np.full(n, window.end_ns, np.int64), "idle_ns": np.full(n, float(window.ns)),
                         "weight": np.ones(n)})


def stall_pieces(trainer_states: pd.DataFrame, start_ns: np.ndarray, end_ns: np.ndarray, run_split: RunSplit,
                 trainer_tid: int | None, host_split: HostSplit | None = None
                 ) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """The trainer's stalled and host-working time inside the windows [start_ns, end_ns)
    (sorted, disjoint): one piece per (state interval, window) overlap, running overlaps
    as one piece per non-user RUN_CLASS weighted by the on-CPU samples, and with
    `host_split` their user part as one piece per HOST_CLASS (a spinning GPU
    synchronisation is neither); `ns` is float ns.  Returns the pieces (PIECE_COLUMNS),
    each piece's window, and its kind (NAMED, UNWOKEN, BOUND, HOST).

    `trainer_states` cut at CUDA waits (cuda.split_at_waits: `interval` the state row,
    `in_wait`) name the GPU waits exactly: a piece inside one is GPU-bound, and every
    stall outside one is named, an unwoken sleep too (the CUDA rows show it was no GPU
    wait).  Without those columns an unwoken sleep is presumed one."""
    s = trainer_states["start_ns"].to_numpy(np.int64)
    e = trainer_states["end_ns"].to_numpy(np.int64)
    ia, iw, ps, pe = intersect(s, e, start_ns, end_ns)
    state = codes(trainer_states["state"])[ia]
    fclass = codes(trainer_states["futex_class"])[ia] if "futex_class" in trainer_states else np.zeros(len(ia), np.int8)
    waker = trainer_states["waker_tid"].to_numpy(np.int64)[ia]
    running = state == STATE_CODE["running"]
    cuda = "in_wait" in trainer_states
    bound = trainer_states["in_wait"].to_numpy(bool)[ia] & ~running if cuda else np.zeros(len(ia), bool)
    interval = trainer_states["interval"].to_numpy(np.int64)[ia] if cuda else ia.astype(np.int64)
    named = is_followed(state, fclass, waker) | (interval_category_codes(state, fclass) != CATEGORY_CODE["other"])
    if cuda:
        named = ~bound
    kind = np.where(bound, BOUND, np.where(named, NAMED, UNWOKEN)).astype(np.int8)
    pieces = pd.DataFrame(
        {"interval": interval, "start_ns": ps, "end_ns": pe, "ns": (pe - ps).astype(np.float64),
         "state": pd.Categorical.from_codes(state, dtype=STATE_DTYPE),
         "run_class": pd.Categorical.from_codes(np.zeros(len(ia), np.int8), dtype=RUN_CLASS_DTYPE)}
    )
    parts, windows, kinds = [pieces[~running]], [iw[~running]], [kind[~running]]
    if running.any() and trainer_tid is not None:
        run, run_w = pieces[running], iw[running]
        a, b = run["start_ns"].to_numpy(), run["end_ns"].to_numpy()
        frac = run_split.fractions(trainer_tid, a, b)
        # a fault or reclaim path is a cause; the user part is host work, by its samples
        shares = [(cls, frac[:, k], NAMED) for k, cls in enumerate(RUN_CLASSES) if cls != "user"]
        if host_split is not None:
            host = host_split.fractions(trainer_tid, a, b)
            shares += [(cls, frac[:, 0] * host[:, k], HOST) for k, cls in enumerate(HOST_CLASSES)]
        for cls, share, what in shares:
            hit = share > 0
            if not hit.any():
                continue
            part = run[hit].copy()
            part["ns"] = part["ns"].to_numpy() * share[hit]
            part["run_class"] = pd.Categorical([cls] * int(hit.sum()), dtype=RUN_CLASS_DTYPE)
            parts.append(part)
            windows.append(run_w[hit])
            kinds.append(np.full(int(hit.sum()), what, np.int8))
    out = pd.concat(parts, ignore_index=True)[list(PIECE_COLUMNS)]
    return out, np.concatenate(windows), np.concatenate(kinds)


def _budget(idle: np.ndarray, named: np.ndarray, host: np.ndarray, unwoken: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per window, the idle time explained in order: named stalls, then host work, then
    (only said, never counted) unwoken sleeps.  Returns (named, host, unwoken) idle ns."""
    by_named = np.minimum(idle, named)
    by_host = np.minimum(idle - by_named, host)
    return by_named, by_host, np.minimum(idle - by_named - by_host, unwoken)


def starved_pieces(
    trainer_states: pd.DataFrame, windows: pd.DataFrame, run_split: RunSplit, trainer_tid: int | None,
    *, budget: bool = True, gaps: pd.DataFrame | None = None, host_split: HostSplit | None = None,
    count_host: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The starved part of the trainer's stalls and host work, and WINDOW_COLUMNS per window.

    `windows` (gpu, start_ns, end_ns, idle_ns, weight; disjoint per GPU).  With `budget`,
    a window's idle time is explained first by its named stalls, then by the trainer's
    host work (`host_split`: its user running time outside GPU synchronisations), each
    shared in proportion to length; unwoken sleeps explain none of it.  Without (no GPU
    samples), every stall counts whole and host work only where CUDA rows show it exactly.
    Each piece's `ns` carries its GPU's weight.

    `gaps`: the trainer's exact launch gaps (cuda.GAP_COLUMNS), where the GPU had finished
    its work and nothing new was queued.  With CUDA rows (`trainer_states` cut at its
    waits) host work counts only inside them, and a window's idle time is at least its
    named stalls and host work inside them, wherever the sample's averaging placed it."""
    cuda = "in_wait" in trainer_states
    pieces, summaries = [], []
    for gpu, rows in windows.groupby("gpu", sort=False):
        rows = rows.sort_values("start_ns", kind="stable")
        w_start, w_end = rows["start_ns"].to_numpy(np.int64), rows["end_ns"].to_numpy(np.int64)
        idle, weight = rows["idle_ns"].to_numpy(np.float64), rows["weight"].to_numpy(np.float64)
        part, win, kind = stall_pieces(trainer_states, w_start, w_end, run_split, trainer_tid, host_split)
        ns = part["ns"].to_numpy(np.float64).copy()
        has_gaps = gaps is not None and len(gaps) > 0
        if cuda:
            host = kind == HOST
            ns[host] = in_gaps_ns(part[host], gaps) if has_gaps else 0.0

        def per_window(k: int, values: np.ndarray = ns) -> np.ndarray:
            return np.bincount(win[kind == k], weights=values[kind == k], minlength=len(rows))

        named_ns, host_ns, unwoken_ns, bound_ns = (per_window(k) for k in (NAMED, HOST, UNWOKEN, BOUND))
        if budget and has_gaps:
            idle = np.maximum(idle, per_window(NAMED, in_gaps_ns(part, gaps)) + (host_ns if cuda else 0.0))
        if budget:
            by_named, by_host, unwoken_idle = _budget(idle, named_ns, host_ns, unwoken_ns)
            factor = np.zeros((4, len(rows)))
            factor[NAMED] = np.divide(by_named, named_ns, out=np.zeros(len(rows)), where=named_ns > 0)
            factor[HOST] = np.divide(by_host, host_ns, out=np.zeros(len(rows)), where=host_ns > 0)
        else:
            by_host = host_ns if cuda or count_host else np.zeros(len(rows))
            by_named = named_ns + unwoken_ns
            unwoken_idle = np.zeros(len(rows))
            factor = np.zeros((4, len(rows)))
            factor[[NAMED, UNWOKEN]] = 1.0
            factor[HOST] = float(cuda or count_host)
        ns = ns * factor[kind, win] * weight[win]
        keep = ns > 0
        part = part[keep].copy()
        part["ns"] = ns[keep]
        pieces.append(part)
        summaries.append(pd.DataFrame({
            "gpu": gpu, "start_ns": w_start, "end_ns": w_end, "idle_ns": idle, "named_ns": named_ns,
            "unwoken_ns": unwoken_ns, "starved_ns": by_named + by_host, "unwoken_idle_ns": unwoken_idle,
            "gpu_bound_ns": bound_ns, "host_ns": host_ns, "host_bound_ns": by_host, "weight": weight,
        }))
    if not pieces:
        empty, _, _ = stall_pieces(trainer_states.iloc[:0], np.zeros(0, np.int64), np.zeros(0, np.int64), run_split, None)
        summary = pd.DataFrame({c: np.zeros(0) for c in WINDOW_COLUMNS}).astype({"gpu": object, "start_ns": np.int64, "end_ns": np.int64})
        return empty, summary[list(WINDOW_COLUMNS)]
    out = pd.concat(pieces, ignore_index=True)
    out = out.sort_values(["start_ns", "run_class"], kind="stable").reset_index(drop=True)[list(PIECE_COLUMNS)]
    return out, pd.concat(summaries, ignore_index=True)[list(WINDOW_COLUMNS)]
