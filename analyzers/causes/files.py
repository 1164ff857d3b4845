"""The files a disk or memory finding names (analyzers/causes/io_culprits.py,
page_cache.py): the trace's rows of a kind, a file's path by (device, inode) from the
`file` rows, and who dirtied it (`dirtied` rows), with that thread's most sampled
Python frame."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.stack_reading import python_frame, stack_frames
from trainbpf.analyzers.intervals import as_int64, intersect

# Threads named per file at most.
MAX_DIRTIERS = 5


def kind_rows(frames: Mapping[str, pd.DataFrame], kind: str) -> pd.DataFrame:
    """The evidence frames' rows of `kind`; empty where the trace has none."""
    frame = frames.get(kind)
    return frame if frame is not None else pd.DataFrame()


def inside(frame: pd.DataFrame, ws: np.ndarray, we: np.ndarray) -> np.ndarray:
    """Per row of a bucketed `frame` (ts_ns, dur_ns), the share of its bucket inside the
    disjoint sorted windows (ws, we)."""
    if not len(frame):
        return np.zeros(0)
    start = as_int64(frame["ts_ns"], 0)
    end = start + np.maximum(as_int64(frame["dur_ns"], 0), 1)
    row, _, s, e = intersect(start, end, ws, we)
    within = np.bincount(row, weights=(e - s).astype(np.float64), minlength=len(frame))
    return within / (end - start)


def file_paths(frames: Mapping[str, pd.DataFrame]) -> dict[tuple[str, int], str]:
    """(device, inode) -> path of every file the recorder named."""
    f = kind_rows(frames, "file")
    if not len(f):
        return {}
    return dict(zip(zip(f["device"].astype(str), as_int64(f["inode"], 0).tolist()), f["path"].astype(str)))


def file_name(f: Mapping[str, Any], device_name: str | None = None) -> str:
    """A file of a finding ({"path", "inode", "device"}): its path, else its inode on
    its device (by `device_name` where known: "vda")."""
    return f["path"] or f"inode {f['inode']} on {device_name or f['device']}"


def of_inode(rows: pd.DataFrame, device: str, inode: int) -> pd.DataFrame:
    if not len(rows):
        return rows
    return rows[(rows["device"].astype(str) == device) & (as_int64(rows["inode"], 0) == inode)]


def dirtiers(ctx: Any, device: str, inode: int) -> list[dict[str, Any]]:
    """The threads that dirtied the file, most folios first, each with its most
    sampled Python frame (None without one)."""
    rows = of_inode(kind_rows(ctx.frames, "dirtied"), device, inode)
    if not len(rows):
        return []
    per = rows.groupby([as_int64(rows["tid"]), as_int64(rows["pid"]), rows["comm"].fillna("").astype(str)])["folios"].sum()
    return [{"tid": int(t), "pid": int(p), "comm": c, "folios": int(n), "function": python_function(ctx, int(t))}
            for (t, p, c), n in per.sort_values(ascending=False).head(MAX_DIRTIERS).items()]


def python_function(ctx: Any, tid: int) -> str | None:
    """A thread's most sampled Python frame, "file.py:25 function"; None without one."""
    s = ctx.samples
    if s is None or "pystack_id" not in s or not len(ctx.pystacks):
        return None
    ids = s["pystack_id"].to_numpy(np.int64)[(s["tid"].to_numpy(np.int64) == tid)]
    ids = ids[ids >= 0]
    if not len(ids):
        return None
    frames = stack_frames(ctx.pystacks, int(pd.Series(ids).value_counts().idxmax()))
    if not frames:
        return None
    f = python_frame(frames[0])
    return f"{str(f['file']).rsplit('/', 1)[-1]}:{f['line']} {f['function']}" if f["file"] else str(f["function"])
