"""Buffer lifetimes: every mapping paired with its unmapping, and per size class how long
buffers live, how many are alive at once and how many faults a step they cost.

- `buffers(mm_syscall, cuda_call)`: one row per mapping (mmap, or the new end of an
  mremap) with the unmapping that ended it (munmap of its start address, or an mremap
  moving it away), and per CUDA allocation the probe saw with the free of its pointer;
  -1 where the trace ends first.  brk moves the heap's end, not a buffer: left out.
- `lifetimes(buffers, faults, step_starts, span)`: per power-of-two size class,
  LIFETIME_COLUMNS, in steps where `step_starts` (the steps' start times: the trainer's
  CUDA steps, else `busy_period_starts` of the GPU's samples) are known.

CUDA allocations and frees shorter than the recorder's min_cuda_ns have no row: such a
buffer is unpaired (never freed, or a free without its allocation, left out).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import NS_PER_S, Span, as_int64

BUFFER_COLUMNS = ("memory", "pid", "addr", "size", "size_class", "map_tid", "map_ns", "unmap_tid", "unmap_ns")
# What a buffer is: mapped by mmap/mremap, or allocated by CUDA on the device or as
# pinned host memory (CUDA_HOST_CALLS).
MEMORY = ("mapped", "cuda_device", "cuda_host")
CUDA_HOST_CALLS = ("cudaHostAlloc", "cudaMallocHost", "cuMemHostAlloc", "cuMemAllocHost")
LIFETIME_COLUMNS = (
    "memory",  # MEMORY
    "size_class",  # bytes: the largest power of two <= the buffer's length
    "buffers",  # mapped in the window
    "freed",  # of them, unmapped before the trace ended
    "alive_at_once",  # buffers of the class alive just after each mapping: median (the pipeline's depth)
    "alive_max",
    "lifetime_s",  # median, of the freed ones
    "lifetime_steps",  # median steps a freed buffer was alive in, 1: the step that mapped it (NaN: no steps known)
    "maps_per_step",  # NaN: no steps known
    "faults_per_step",  # the mapping threads' faults, shared among mapped classes by bytes (NaN: no steps)
    "faults_per_s",
    "map_tid",  # the thread that mapped most of them
    "unmap_tid",  # the thread that unmapped most of them (-1: none)
)
# Buffers smaller than this are malloc's and the interpreter's own small mappings.
MIN_BUFFER_BYTES = 256 << 10


def _event_rows(pick: np.ndarray, memory: Any, pid: np.ndarray, at: np.ndarray, size: np.ndarray, tid: np.ndarray,
                when: np.ndarray, sign: int) -> list[np.ndarray]:
    """The picked events as arrays: memory code (MEMORY), pid, address, size, tid, time,
    sign (+1 a mapping or allocation, -1 an unmapping or free)."""
    memory = np.broadcast_to(np.asarray(memory, dtype=np.int8), pick.shape)
    return [memory[pick], pid[pick], at[pick], size[pick], tid[pick], when[pick], np.full(int(pick.sum()), sign, np.int8)]


def _events(mm: pd.DataFrame) -> list[list[np.ndarray]]:
    """Mappings (+1) and unmappings (-1) by start address: mmap's returned address,
    munmap's address, an mremap's old address (-1) and new one (+1)."""
    code, names = pd.factorize(mm["syscall"])  # a few syscall names, decoded once each

    def named(syscall: str) -> np.ndarray:
        return np.append(np.asarray(names, dtype=object) == syscall, False)[code]

    ts, dur = as_int64(mm["ts_ns"], 0), np.maximum(as_int64(mm["dur_ns"], 0), 0)
    addr, ret, size = as_int64(mm["addr"], 0), as_int64(mm["ret"], -1), as_int64(mm["length"], 0)
    tid, pid = as_int64(mm["tid"]), as_int64(mm["pid"])
    ok_map = ret > 0  # a failed mmap returns -errno; 0 is never a user mapping
    mremap = named("mremap") & ok_map
    return [_event_rows(pick, 0, pid, at, size, tid, when, sign) for pick, at, sign, when in (
        (named("mmap") & ok_map, ret, 1, ts + dur), (mremap, ret, 1, ts + dur), (mremap, addr, -1, ts),
        (named("munmap") & (ret == 0), addr, -1, ts))]


def _cuda_events(calls: pd.DataFrame) -> list[list[np.ndarray]]:
    """CUDA allocations (+1, at their return, by the pointer they returned) and frees (-1)
    that succeeded; a driver call inside a runtime call is the runtime call's own."""
    state = calls["state"].astype(str).to_numpy()
    ts, dur = as_int64(calls["ts_ns"], 0), np.maximum(as_int64(calls["dur_ns"], 0), 0)
    ok = (as_int64(calls["ret"], -1) == 0) & (as_int64(calls["nested"], 0) == 0) & (as_int64(calls["addr"], 0) > 0)
    host = np.isin(calls["name"].astype(str).to_numpy(), CUDA_HOST_CALLS)
    memory = np.where(host, MEMORY.index("cuda_host"), MEMORY.index("cuda_device"))
    cols = (as_int64(calls["pid"]), as_int64(calls["addr"], 0), as_int64(calls["bytes"], 0), as_int64(calls["tid"]))
    return [_event_rows(ok & (state == "alloc"), memory, *cols, ts + dur, 1),
            _event_rows(ok & (state == "free"), memory, *cols, ts, -1)]


def buffers(mm_syscall: pd.DataFrame, cuda_call: pd.DataFrame | None = None) -> pd.DataFrame:
    """BUFFER_COLUMNS, one row per mapping or CUDA allocation of the trace, ordered by its
    time."""
    parts = (_events(mm_syscall) if len(mm_syscall) else []) + (
        _cuda_events(cuda_call) if cuda_call is not None and len(cuda_call) else [])
    if not parts:
        return pd.DataFrame({c: np.zeros(0, object if c == "memory" else np.int64) for c in BUFFER_COLUMNS})
    memory, pid, addr, size, tid, ts, sign = (np.concatenate(col) for col in zip(*parts))
    # Mappings and CUDA's pointers apart (the driver maps pinned memory too): a mapping
    # ends at the next event at its address if that is an unmapping.
    space = memory > 0
    order = np.lexsort((sign, ts, addr, pid, space))
    memory, pid, addr, size, tid, ts, sign, space = (a[order] for a in (memory, pid, addr, size, tid, ts, sign, space))
    ended = np.append((space[1:] == space[:-1]) & (pid[1:] == pid[:-1]) & (addr[1:] == addr[:-1]) & (sign[1:] == -1),
                      False)
    maps = np.flatnonzero(sign == 1)
    end = ended[maps]
    nxt = np.minimum(maps + 1, len(sign) - 1)
    out = pd.DataFrame({
        "memory": np.asarray(MEMORY, dtype=object)[memory[maps]], "pid": pid[maps], "addr": addr[maps],
        "size": size[maps], "size_class": size_class(size[maps]), "map_tid": tid[maps], "map_ns": ts[maps],
        "unmap_tid": np.where(end, tid[nxt], -1), "unmap_ns": np.where(end, ts[nxt], -1),
    })
    return out.sort_values("map_ns", kind="stable", ignore_index=True)[list(BUFFER_COLUMNS)]


def freed_by_others(bufs: pd.DataFrame, span: Span) -> pd.Series:
    """Per mapping thread, the bytes of its mappings inside `span` that another thread
    unmapped (a loader mapping batches the trainer frees gives them back all the same)."""
    m = ((bufs["memory"] == "mapped") & (bufs["map_ns"] >= span.start_ns) & (bufs["map_ns"] < span.end_ns)
         & (bufs["unmap_tid"] >= 0) & (bufs["unmap_tid"] != bufs["map_tid"])).to_numpy()
    return bufs[m].groupby("map_tid")["size"].sum().astype(np.float64)


def size_class(size: np.ndarray) -> np.ndarray:
    """The largest power of two <= each size (0 for sizes < 1)."""
    size = np.asarray(size, dtype=np.int64)
    exp = np.floor(np.log2(np.maximum(size, 1))).astype(np.int64)
    return np.where(size >= 1, np.left_shift(np.int64(1), exp), 0)


def busy_period_starts(windows: pd.DataFrame) -> np.ndarray:
    """Where the GPU's busy periods start, as steps where CUDA calls show none: each run
    of sample windows (gpu, start_ns, end_ns, idle_ns) busy at least half their length,
    on the first GPU; none when no window is idle or none busy (no rhythm to count)."""
    if not len(windows):
        return np.zeros(0, np.int64)
    w = windows[windows["gpu"].to_numpy(dtype=object) == windows["gpu"].iloc[0]].sort_values("start_ns")
    length = (w["end_ns"] - w["start_ns"]).to_numpy(np.float64)
    busy = w["idle_ns"].to_numpy(np.float64) < 0.5 * length
    if busy.all() or not busy.any():
        return np.zeros(0, np.int64)
    rising = busy & ~np.concatenate([[False], busy[:-1]])
    return w["start_ns"].to_numpy(np.int64)[rising]


def class_label(size_class: int) -> str:
    """A power-of-two size class in binary units: "8 MiB"."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if size_class >= 1 << shift:
            return f"{size_class / (1 << shift):g} {unit}"
    return f"{size_class} B"


def _alive_after_maps(cls_rows: pd.DataFrame, end_ns: int) -> np.ndarray:
    """How many buffers of one class are alive just after each of its mappings."""
    unmap = cls_rows["unmap_ns"].to_numpy(np.int64)
    t = np.concatenate([cls_rows["map_ns"].to_numpy(np.int64), np.where(unmap >= 0, unmap, end_ns)])
    d = np.concatenate([np.ones(len(cls_rows), np.int64), -np.ones(len(cls_rows), np.int64)])
    order = np.lexsort((-d, t))  # at the same instant, the mapping first: a handover counts both
    alive = np.cumsum(d[order])
    return alive[np.argsort(order)[:len(cls_rows)]]


def _most(values: np.ndarray) -> int:
    values = values[values >= 0]
    return int(pd.Series(values).value_counts().idxmax()) if len(values) else -1


def lifetimes(bufs: pd.DataFrame, faults: pd.DataFrame, step_starts: np.ndarray | None, span: Span) -> pd.DataFrame:
    """LIFETIME_COLUMNS per memory and size class of the buffers (BUFFER_COLUMNS, >=
    MIN_BUFFER_BYTES) mapped inside `span`, by MEMORY, largest class first.  `faults`: the trace's faults rows (per
    thread); `step_starts`: the steps' start times (None or empty: unknown)."""
    keep = ((bufs["map_ns"] >= span.start_ns) & (bufs["map_ns"] < span.end_ns)
            & (bufs["size"] >= MIN_BUFFER_BYTES)).to_numpy()
    b = bufs[keep]
    steps = np.sort(np.asarray(step_starts if step_starts is not None else [], dtype=np.int64))
    steps = steps[(steps >= span.start_ns) & (steps < span.end_ns)]
    n_steps = len(steps)
    seconds = max(span.seconds, 1e-9)
    fl = faults[(as_int64(faults["ts_ns"]) >= span.start_ns) & (as_int64(faults["ts_ns"]) < span.end_ns)] \
        if len(faults) else faults
    per_thread = pd.Series(np.maximum(as_int64(fl["faults"], 0), 0) if len(fl) else [],
                           index=as_int64(fl["tid"]) if len(fl) else [], dtype=np.int64).groupby(level=0).sum()
    # A thread's faults, shared among the classes it maps by the bytes it maps of each
    # (CUDA's device memory does not fault on the host; pinned memory faults in the
    # driver's own mappings).
    share = b[b["memory"] == "mapped"].groupby(["map_tid", "size_class"])["size"].sum()
    share = share / share.groupby(level=0).transform("sum")
    class_faults = (share * per_thread.reindex(share.index.get_level_values(0)).fillna(0).to_numpy()).groupby(
        level=1).sum() if len(share) else pd.Series(dtype=np.float64)
    rows = []
    for (memory, cls), rows_of in b.groupby(["memory", "size_class"], sort=True):
        freed = rows_of[rows_of["unmap_ns"] >= 0]
        life_ns = (freed["unmap_ns"] - freed["map_ns"]).to_numpy(np.int64)
        crossed = 1 + (np.searchsorted(steps, freed["unmap_ns"].to_numpy(np.int64), side="right")
                   - np.searchsorted(steps, freed["map_ns"].to_numpy(np.int64), side="right"))
        alive = _alive_after_maps(rows_of, span.end_ns)
        n_faults = float(class_faults.get(cls, 0.0)) if memory == "mapped" else 0.0
        rows.append({
            "memory": memory, "size_class": int(cls), "buffers": len(rows_of), "freed": len(freed),
            "alive_at_once": float(np.median(alive)), "alive_max": int(alive.max()),
            "lifetime_s": float(np.median(life_ns)) / NS_PER_S if len(freed) else np.nan,
            "lifetime_steps": float(np.median(crossed)) if n_steps and len(freed) else np.nan,
            "maps_per_step": len(rows_of) / n_steps if n_steps else np.nan,
            "faults_per_step": n_faults / n_steps if n_steps else np.nan,
            "faults_per_s": n_faults / seconds,
            "map_tid": _most(rows_of["map_tid"].to_numpy(np.int64)),
            "unmap_tid": _most(freed["unmap_tid"].to_numpy(np.int64)),
        })
    out = pd.DataFrame(rows, columns=list(LIFETIME_COLUMNS))
    order = out["memory"].map({m: i for i, m in enumerate(MEMORY)})
    out = out.assign(order=order).sort_values(["order", "size_class"], ascending=[True, False], ignore_index=True)
    return out.drop(columns="order").astype({
        c: np.int64 for c in ("size_class", "buffers", "freed", "alive_max", "map_tid", "unmap_tid")})


# Batch-sized buffers held late: at least this large, mapped afresh at least this often,
# at least this many alive at once (each mapping while earlier ones still wait), and
# most of them freed within the trace (a pool that is kept is not churn).
HELD_MIN_BYTES = 1 << 20
HELD_MIN_BUFFERS = 8
HELD_MIN_ALIVE = 2.0
HELD_MIN_FREED = 0.5


def held_class(table: pd.DataFrame, tids: list[int] | None = None) -> pd.Series | None:
    """The size class (a LIFETIME_COLUMNS row) whose buffers are freed late, mapped or
    unmapped by `tids` where one such class is, the most bytes mapped first; None: none."""
    held = table[(table["memory"] == "mapped") & (table["size_class"] >= HELD_MIN_BYTES) & (table["buffers"] >= HELD_MIN_BUFFERS)
                 & (table["alive_at_once"] >= HELD_MIN_ALIVE) & (table["freed"] >= HELD_MIN_FREED * table["buffers"])]
    if tids:
        theirs = held[held["map_tid"].isin(tids) | held["unmap_tid"].isin(tids)]
        held = theirs if len(theirs) else held
    if not len(held):
        return None
    return held.loc[(held["size_class"] * held["buffers"]).idxmax()]
