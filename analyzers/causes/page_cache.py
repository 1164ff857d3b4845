"""What filled memory while a finding's threads reclaimed it, and what they read again
after it was dropped (docs/findings.md, "Memory culprits").

From the recorder's `memory_cgroup` rows (each traced process's memory cgroup: its limit,
usage and page-cache breakdown, sampled) and `page_cache` rows (pages added to, dropped
from and added back to the page cache, per file, counted in the kernel):

- a `memory_reclaim` finding names the cgroup it reclaimed in, its limit, how much of it
  was page cache and which files filled it (and who dirtied them);
- a `block_io` finding whose reads were pages dropped earlier in the recording names the
  file read again and the file whose pages filled the cache meanwhile.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.files import dirtiers, file_name, file_paths, inside, kind_rows
from trainbpf.analyzers.intervals import as_int64

PAGE_BYTES = 4096
# A cgroup whose page cache is at least this share of its usage is full of files.
CACHE_MIN_SHARE = 0.5
# Dirty and under-writeback pages from this share of usage: reclaim waits on writeback.
DIRTY_MIN_SHARE = 0.1
# Refaulted bytes during the waits from this share of the waiting threads' reads: they
# re-read what the cache dropped.
REFAULT_MIN_SHARE = 0.25
MAX_FILES = 5


def victim_cgroup(ctx: Any, roots: list[int]) -> dict[str, Any] | None:
    """The memory cgroup of the threads `roots`' process (the first root's; the only
    cgroup when the rows name another process for it: a row names one traced process of
    its cgroup), with each key's largest value over the window (the limits: their last)
    and `dirty`, the most of it dirty or under writeback at once; None without rows."""
    rows = kind_rows(ctx.frames, "memory_cgroup")
    if not len(rows) or not roots:
        return None
    threads = ctx.threads
    pid = int(threads.loc[threads["tid"] == roots[0], "pid"].iloc[0]) if (threads["tid"] == roots[0]).any() else roots[0]
    mine = rows[as_int64(rows["pid"]) == pid]
    if not len(mine) and rows["cgroup"].nunique() == 1:
        mine = rows
    if not len(mine):
        return None
    path = str(mine.sort_values("ts_ns")["cgroup"].iloc[-1])
    of = rows[rows["cgroup"].astype(str) == path]
    ts = as_int64(of["ts_ns"], 0)
    within = (ts >= ctx.window.start_ns) & (ts <= ctx.window.end_ns)
    of = of[within] if within.any() else of
    values = of.assign(value=pd.to_numeric(of["value"], errors="coerce")).pivot_table(
        index="ts_ns", columns="key", values="value", aggfunc="last", observed=True).sort_index()
    out: dict[str, Any] = {"path": path, "pids": sorted({int(p) for p in as_int64(of["pid"]) if p >= 0})}
    for key in values.columns:
        v = values[key].dropna()
        if len(v):
            out[str(key)] = float(v.iloc[-1] if key in ("max", "high", "version") else v.max())
    dirty = values.reindex(columns=["file_dirty", "file_writeback"]).fillna(0).sum(axis=1)
    out["dirty"] = float(dirty.max()) if len(dirty) else 0.0
    return out


def cache_fillers(ctx: Any, pids: list[int], roots: list[int]) -> list[dict[str, Any]]:
    """The files that filled the page cache over the window, most first: by the pages
    added to it (`page_cache` rows, an opt-in probe) or the folios dirtied in it,
    whichever is more; among those the processes `pids` had open, mapped or dirtied (the
    page cache is the machine's: other processes' files are not this cgroup's), leaving
    out the files only the waiting threads `roots` dirtied (their own writes are not
    what pushed them into reclaim).  Each with its path and dirtiers."""
    frames = ctx.frames
    theirs: set[tuple[str, int]] = set()
    for kind in ("file", "dirtied"):  # the files they opened, mapped or dirtied
        rows = kind_rows(frames, kind)
        if len(rows):
            rows = rows[np.isin(as_int64(rows["pid"]), pids)]
            theirs |= set(zip(rows["device"].astype(str), as_int64(rows["inode"], 0).tolist()))
    dirtied = ctx.rows("dirtied")
    folios = pd.Series(dtype=np.float64)
    if len(dirtied):
        others = dirtied[~np.isin(as_int64(dirtied["tid"]), roots)]
        folios = pd.Series(as_int64(others["folios"], 0), index=others.index).groupby(
            [others["device"].astype(str), as_int64(others["inode"], 0)]).sum()
        own = set(zip(dirtied["device"].astype(str), as_int64(dirtied["inode"], 0).tolist())) - set(folios.index)
        theirs -= own
    pc = ctx.rows("page_cache")
    added = pd.Series(dtype=np.float64)
    if len(pc):
        pc = pc[pc["change"].astype(str) == "added"]
        added = pd.Series(as_int64(pc["pages"], 0), index=pc.index).groupby(
            [pc["device"].astype(str), as_int64(pc["inode"], 0)]).sum()
    score = pd.concat([added, folios], axis=1).fillna(0).max(axis=1) if len(added) or len(folios) else added
    score = score[[k in theirs for k in score.index]] if len(score) else score
    paths = file_paths(frames)
    out = []
    for (device, inode), _ in score.sort_values(ascending=False).head(MAX_FILES).items():
        key = (device, int(inode))
        out.append({"device": device, "inode": int(inode), "path": paths.get(key),
                    "added_bytes": int(added.get(key, 0)) * PAGE_BYTES, "dirtied_bytes": int(folios.get(key, 0)) * PAGE_BYTES,
                    "dirtiers": dirtiers(ctx, device, int(inode))})
    return out


def reclaim_culprits(ctx: Any, roots: list[int]) -> dict[str, Any]:
    """A memory_reclaim finding's `cgroup` and `page_cache` evidence, with its `case`
    ("page_cache": the cgroup is full of files; "anon": of its processes' memory) and
    `names`; {} without cgroup rows."""
    cgroup = victim_cgroup(ctx, roots)
    if cgroup is None:
        return {}
    fillers = cache_fillers(ctx, cgroup["pids"], roots)
    usage = cgroup.get("usage") or cgroup.get("max") or 0.0
    file_share = min(1.0, cgroup.get("file", 0.0) / usage) if usage else 0.0
    dirty = cgroup["dirty"]
    out = {"cgroup": cgroup, "page_cache": fillers}
    names: dict[str, Any] = {"cgroup": cgroup["path"], "file_share": file_share,
                             "limit": "no limit" if "max" not in cgroup else None}
    if "max" in cgroup:
        names["limit_bytes"] = cgroup["max"]
        names.pop("limit")
    if file_share < CACHE_MIN_SHARE:
        names["anon_bytes"] = cgroup.get("anon", 0.0)
        return {**out, "case": "anon", "names": names}
    top = fillers[0] if fillers else None
    writer = top["dirtiers"][0] if top and top["dirtiers"] else None
    names.update({
        "file": file_name(top) if top else "files the trace did not see opened",
        "by": f", dirtied by {writer['comm']} ({writer['tid']})" if writer else "",
        "file_user": writer["comm"] if writer else "the process that reads or writes it",
        "dirty": f"; {dirty / usage:.0%} of it dirty or under writeback, so reclaim waited for the disk"
                 if usage and dirty >= DIRTY_MIN_SHARE * usage else "",
    })
    return {**out, "case": "page_cache", "names": names}


def _rewritten(ctx: Any, device: str) -> set[int]:
    """Inodes dirtied on `device` over the window: their pages come back after a
    truncation as they do after eviction, and the kernel's events do not tell the two
    apart, so their returns are not counted as refaults."""
    d = ctx.rows("dirtied")
    if not len(d):
        return set()
    d = d[d["device"].astype(str) == device]
    return set(as_int64(d["inode"], 0).tolist())


def refaulted(ctx: Any, device: str, ws: np.ndarray, we: np.ndarray, read_bytes: float) -> dict[str, Any] | None:
    """The file whose dropped pages were read again during the waits (ws, we) on
    `device`, when that is at least REFAULT_MIN_SHARE of `read_bytes` (the waiting
    threads' reads), with the file that was added to the cache most meanwhile (what
    pushed it out)."""
    pc = kind_rows(ctx.frames, "page_cache")
    if not len(pc) or read_bytes <= 0:
        return None
    pc = pc[pc["device"].astype(str) == device]
    back = pc[(pc["change"].astype(str) == "refaulted") & ~np.isin(as_int64(pc["inode"], 0), list(_rewritten(ctx, device)))]
    if not len(back):
        return None
    per = pd.Series(inside(back, ws, we) * as_int64(back["pages"], 0) * PAGE_BYTES, index=back.index).groupby(
        as_int64(back["inode"], 0)).sum()
    inode, again = int(per.idxmax()), float(per.max())
    if again < REFAULT_MIN_SHARE * read_bytes:
        return None
    added = pc[(pc["change"].astype(str) == "added") & (as_int64(pc["inode"], 0) != inode)]
    paths = file_paths(ctx.frames)
    out: dict[str, Any] = {"device": device, "inode": inode, "path": paths.get((device, inode)),
                           "refaulted_bytes": again, "evictor": None}
    if len(added):
        filled = pd.Series(as_int64(added["pages"], 0), index=added.index).groupby(as_int64(added["inode"], 0)).sum()
        other = int(filled.idxmax())
        out["evictor"] = {"device": device, "inode": other, "path": paths.get((device, other)),
                          "added_bytes": int(filled.max()) * PAGE_BYTES, "dirtiers": dirtiers(ctx, device, other)}
    return out


def refault_names(refault: dict[str, Any], device_name: str | None = None) -> dict[str, Any]:
    """The `names` of a block_io finding's "refault" case (files on `device_name`)."""
    evictor = refault["evictor"]
    writer = evictor["dirtiers"][0] if evictor and evictor["dirtiers"] else None
    by = f" written by {writer['comm']} ({writer['tid']})" if writer else ""
    return {"file": file_name(refault, device_name), "refaulted_bytes": refault["refaulted_bytes"],
            "evictor": file_name(evictor, device_name) + by if evictor else "other files",
            "evictor_name": writer["comm"] if writer else "the other files' writers"}
