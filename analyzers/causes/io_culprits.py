"""What made the disk busy while a finding's threads waited on it (docs/findings.md,
"Disk culprits"): the device, every issuer's bytes on it during the waits (the recorder
counts every block request in the kernel: `disk_io` rows), the files whose writeback
filled it (`writeback_inode`), the threads that dirtied them (`dirtied`) and the path
each file is written by (`write_path`).

The waits are the finding's starved pieces: the trainer's time, during which the thread
at the end of its chain waited for the disk.  A row counted per bucket is weighted by
the part of its bucket that lies inside those waits.  From the shares the evidence
takes a `case` (analyzers/causes/categories.py): the victim's own I/O alone on the disk
(no case: the storage is the limit), another writer's writeback, another thread's
O_DIRECT writes, or another process's I/O.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.files import dirtiers, file_name, file_paths, inside, kind_rows, of_inode
from trainbpf.analyzers.causes.page_cache import refault_names, refaulted
from trainbpf.analyzers.intervals import as_int64, merge_intervals
from trainbpf.trace.schema import kernel_device

# The kinds it (and page_cache.py) reads beside the victims' block_rq and dirty_pause rows.
IO_KINDS = ("disk_io", "writeback_inode", "dirtied", "file", "block_device", "write_path", "page_cache",
           "memory_cgroup")
# Others' bytes below this share of the device's during the waits: the victims' own I/O
# is the load.  Reads are served before writes, so a writer with a quarter of the bytes
# already lengthens every read.
OTHERS_MIN_SHARE = 0.25
# Files and threads named at most.
MAX_NAMED = 5
# How the writer of a file written back writes it (its `write_path` rows' path with the
# most bytes; buffered without rows): (the summary's words after the writer, the advice's).
_THROUGH = {
    "buffered": ("", "through the page cache"),
    "mapped": (" through a shared mapping", "through a shared mapping (mmap), whose dirty pages msync and the "
               "kernel's writeback write out as they do buffered writes"),
}


def _waited_devices(frames: Mapping[str, pd.DataFrame], roots: list[int], ws: np.ndarray, we: np.ndarray) -> list[str]:
    """The devices the victims' own requests and dirty pauses went to during the waits,
    most first."""
    per: dict[str, float] = {}
    rq = kind_rows(frames, "block_rq")
    if len(rq):
        rq = rq[np.isin(as_int64(rq["tid"]), roots)]
        w = inside(rq.assign(dur_ns=np.maximum(as_int64(rq["dur_ns"], 0), 1)), ws, we) * as_int64(rq["bytes"], 0)
        for dev, b in pd.Series(w).groupby(as_int64(rq["dev"], 0)).sum().items():
            per[kernel_device(dev)] = per.get(kernel_device(dev), 0.0) + float(b) + 1.0
    pauses = kind_rows(frames, "dirty_pause")
    if len(pauses):
        pauses = pauses[np.isin(as_int64(pauses["tid"]), roots)]
        for dev, n in pauses["device"].dropna().astype(str).value_counts().items():
            per[dev] = per.get(dev, 0.0) + float(n)
    return [d for d, _ in sorted(per.items(), key=lambda kv: -kv[1])]


def io_culprits(ctx: Any, pieces: pd.DataFrame, roots: list[int], *, dirtying: bool = False) -> dict[str, Any]:
    """The `io` evidence of a finding whose `pieces` (findings.ATTRIBUTED_COLUMNS) ended
    in disk waits of threads `roots`, with its `case` and `names` where it found a
    culprit; {} when the trace has no per-device counts (an older recorder).  `dirtying`
    (dirty throttling): files are ranked by the folios others dirtied during the waits,
    not by the bytes written back."""
    frames = ctx.frames
    disk = kind_rows(frames, "disk_io")
    if not len(disk) or not len(pieces):
        return {}
    ws, we = merge_intervals(pieces["start_ns"].to_numpy(np.int64), pieces["end_ns"].to_numpy(np.int64))
    roots = [int(r) for r in roots]
    waited = _waited_devices(frames, roots, ws, we)
    weight = inside(disk, ws, we)
    on = disk.assign(weighted=weight * as_int64(disk["bytes"], 0))
    on = on[on["weighted"] > 0]
    if not len(on):
        return {}
    devices = waited or [str(on.groupby("device")["weighted"].sum().idxmax())]
    on = on[on["device"].astype(str).isin(devices)]
    names = _device_names(frames)
    issuers = _issuers(on, roots)
    total = float(issuers["bytes"].sum()) if len(issuers) else 0.0
    victim = float(issuers.loc[issuers["victim"], "bytes"].sum()) if len(issuers) else 0.0
    files = _files(ctx, devices, ws, we, roots, dirtying=dirtying)
    out = {
        "devices": [{"device": d, "name": names.get(d, d)} for d in devices],
        "bytes": total, "victim_bytes": victim,
        "issuers": issuers.head(MAX_NAMED).to_dict("records"),
        "files": files,
        "files_by": "dirtied" if dirtying else "written_back",  # what each file's bytes are
    }
    device = names.get(devices[0], devices[0])
    # Shares of the data moved: a discard or a cache flush says nothing of bytes by its size.
    rw = issuers[issuers["direction"] != "other"]
    moved = {"bytes": float(rw["bytes"].sum()), "others": float(rw.loc[~rw["victim"], "bytes"].sum()),
             "flushed": float(rw.loc[~rw["victim"] & rw["flusher"], "bytes"].sum())}
    case = _case(out, device, kind_rows(frames, "write_path"), paths=file_paths(frames), moved=moved)
    if not dirtying:  # their reads: of pages the page cache had dropped?
        reads = float(issuers.loc[issuers["victim"] & (issuers["direction"] == "read"), "bytes"].sum())
        again = refaulted(ctx, devices[0], ws, we, reads)
        if again:
            out["refaulted"] = again
            case = case or {"case": "refault", "names": {"device": device, **refault_names(again, device)}}
    return {"io": out, **case}


def _device_names(frames: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    bd = kind_rows(frames, "block_device")
    return dict(zip(bd["device"].astype(str), bd["name"].astype(str))) if len(bd) else {}


def _issuers(on: pd.DataFrame, roots: list[int]) -> pd.DataFrame:
    """Bytes and requests per (issuing task, direction) during the waits, most first."""
    keys = ["tid", "pid", "comm", "direction"]
    g = on.assign(tid=as_int64(on["tid"]), pid=as_int64(on["pid"]), comm=on["comm"].fillna("").astype(str),
                  direction=on["direction"].fillna("other").astype(str))
    per = g.groupby(keys, sort=False)["weighted"].sum().rename("bytes").reset_index()
    per["victim"] = per["tid"].isin(roots)
    per["flusher"] = per["comm"].str.startswith("kworker")
    return per.sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True)


def _files(ctx: Any, devices: list[str], ws: np.ndarray, we: np.ndarray, roots: list[int], *,
           dirtying: bool) -> list[dict[str, Any]]:
    """The files on `devices` written back (or, `dirtying`, dirtied by others) during
    the waits, most bytes first, each with its path, write paths and dirtiers."""
    frames = ctx.frames
    rows = kind_rows(frames, "dirtied" if dirtying else "writeback_inode")
    if not len(rows):
        return []
    rows = rows[rows["device"].astype(str).isin(devices)]
    if dirtying:
        rows = rows[~np.isin(as_int64(rows["tid"]), roots)]
    amount = as_int64(rows["folios"], 0) * 4096 if dirtying else as_int64(rows["bytes"], 0)
    w = pd.Series(inside(rows, ws, we) * amount, index=rows.index)
    per = w.groupby([rows["device"].astype(str), as_int64(rows["inode"], 0)]).sum()
    per = per[per > 0].sort_values(ascending=False).head(MAX_NAMED)
    paths = file_paths(frames)
    write_path = kind_rows(frames, "write_path")
    out = []
    for (device, inode), b in per.items():
        out.append({"device": device, "inode": int(inode), "path": paths.get((device, int(inode))),
                    "bytes": float(b), "write_paths": _write_paths(write_path, device, int(inode)),
                    "dirtiers": dirtiers(ctx, device, int(inode))})
    return out


def _write_paths(write_path: pd.DataFrame, device: str, inode: int) -> dict[str, float]:
    rows = of_inode(write_path, device, inode)
    return {str(k): float(v) for k, v in rows.groupby(rows["path"].astype(str))["bytes"].sum().items()} if len(rows) else {}


def _through(write_paths: Mapping[str, float]) -> dict[str, str]:
    """The writeback case's `via` (summary) and `through` (advice): how the file is written."""
    paths = {p: b for p, b in write_paths.items() if p in _THROUGH}
    via, through = _THROUGH[max(paths, key=paths.__getitem__) if paths else "buffered"]
    return {"via": via, "through": through}


def _who(tid: int, comm: str, function: str | None = None) -> str:
    return f"{comm or '?'} ({tid})" + (f" at {function}" if function else "")


def _case(io: dict[str, Any], device: str, write_path: pd.DataFrame, *, paths: Mapping[tuple[str, int], str],
          moved: Mapping[str, float]) -> dict[str, Any]:
    """The evidence's `case` and `names` (analyzers/causes/categories.py cases of block_io
    and dirty_throttling): who besides the victims filled `device`.  `paths`: file_paths;
    `moved`: the bytes read or written during the waits, all, others' and flushers'."""
    files = io["files"]
    others = [i for i in io["issuers"] if not i["victim"] and i["direction"] != "other"]
    total, other_bytes = moved["bytes"], moved["others"]
    if total <= 0 or other_bytes < OTHERS_MIN_SHARE * total:
        return {}  # the victims' own I/O is the load: the storage is the limit
    flushed = moved["flushed"]
    if files and (flushed >= 0.5 * other_bytes or files[0]["bytes"] >= 0.5 * other_bytes):
        top = files[0]
        writer = top["dirtiers"][0] if top["dirtiers"] else None
        return {"case": "writeback", "names": {
            "device": device, "file": file_name(top, device),
            "written_bytes": top["bytes"],
            "writer": _who(writer["tid"], writer["comm"], writer["function"]) if writer else "a writer before the recording",
            "writer_name": writer["comm"] if writer else "the file's writer", **_through(top["write_paths"])}}
    others = [i for i in others if not i["flusher"]]  # a flusher writes back someone's files: named above
    if not others:
        return {}
    top = others[0]
    names = {"device": device, "issuer": _who(top["tid"], top["comm"]), "issuer_name": top["comm"] or "?",
             "issued_bytes": sum(i["bytes"] for i in others if i["tid"] == top["tid"])}
    direct = write_path[(as_int64(write_path["tid"]) == top["tid"]) & (write_path["path"].astype(str) == "direct")] \
        if len(write_path) else write_path
    if top["direction"] == "write" and len(direct):
        dev, inode = pd.Series(as_int64(direct["bytes"], 0), index=direct.index).groupby(
            [direct["device"].astype(str), as_int64(direct["inode"], 0)]).sum().idxmax()
        names["file"] = file_name({"path": paths.get((dev, int(inode))), "inode": int(inode), "device": dev}, device)
        return {"case": "direct_writes", "names": names}
    return {"case": "other_io", "names": names}
