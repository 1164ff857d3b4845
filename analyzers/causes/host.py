"""The trainer's own work on the CPU (docs/findings.md, "Host-bound time").

Each on-CPU sample whose kernel stack shows ordinary user work gets a host label from
its stacks, native frames deciding only where the sample has no Python stack:

- `sync`: the native user stack is inside the CUDA driver's synchronisation or a
  blocking copy (stacks.USER_PATTERNS "gpu_sync"): a spinning wait for a busy GPU,
  GPU-bound time and never host work.
- `loading`: data loading in the sampled thread itself.  A Python frame anywhere on the
  stack is data loading when its function is `__getitem__`/`__getitems__` or its name
  holds collate, decode, tokenise/tokenize, augment or starts with transform, or when
  its file is the DataLoader's own code (torch/utils/data/: `_next_data`, the fetchers,
  `default_collate`), torchvision's transforms, io or datasets, PIL, or a tokenizer
  library.  With workers the trainer's time in the DataLoader is only the hand-over
  (receiving batches), which is still time spent getting data, and small.
- `compute`: everything else: an optimizer step on the CPU, Python between launches,
  logging.
- `unknown`: no Python stack in a trace that has them (the walk missed this sample,
  typically inside a C extension) and no data-loading native leaf: such a sample counts
  for neither, its stretch divides like its thread's others.  In a trace without any
  Python stack the native leaf alone decides (loading or compute).

`HostSplit` divides a thread's user running time between these labels by its samples,
as RunSplit divides running time between kernel classes.  The evidence builders name
the functions that host-bound time went to (each sample's leaf-most frame in the
program's own code; for data loading its leaf-most data-loading frame) and how much of
the host work the kernel took (fault and reclaim paths, preemption, remote NUMA).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes import evidence as ev
from trainbpf.analyzers.causes.stack_reading import (
    CLASS_CODE,
    LIBRARY_FILE,
    python_frame,
    stack_class_codes,
)
from trainbpf.analyzers.intervals import NS_PER_S, as_int64
from trainbpf.analyzers.threads.states import clipped_lengths as clipped
from trainbpf.analyzers.vocab import HOST_CLASSES, STATE_CODE, codes

# A sample's host label: a host class (vocab.HOST_CLASSES), then "sync" and "unknown".
HOST_LABELS: tuple[str, ...] = HOST_CLASSES + ("sync", "unknown")
HOST_LABEL_CODE: dict[str, int] = {name: i for i, name in enumerate(HOST_LABELS)}
DATA_LOADING_FUNCTION = re.compile(r"^__getitems?__$|collate|decode|tokeni[sz]e|augment|^transform", re.IGNORECASE)
DATA_LOADING_FILE = re.compile(
    r"/torch/utils/data/|/torchvision/(?:transforms|io|datasets)/|/PIL/|/tokenizers/|/transformers/tokenization_")
# Functions a host finding names at most.
MAX_FUNCTIONS = 5


def _is_loading(frame: dict[str, Any]) -> bool:
    function = str(frame["function"]).rsplit(".", 1)[-1]
    return bool(DATA_LOADING_FUNCTION.search(function) or DATA_LOADING_FILE.search(str(frame["file"])))


def _own_first(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The leaf-most frame in the program's own code, else the leaf; None without frames."""
    return next((f for f in frames if not LIBRARY_FILE.search(str(f["file"]))), frames[0] if frames else None)


def _label(python: str, native: str, sync: bool, traced_python: bool) -> tuple[int, str]:
    """(host label code, function frame text) of one sample's stacks (frames leaf first,
    joined by ";"; "" where unknown); `traced_python`: the trace has Python stacks."""
    if sync:
        return HOST_LABEL_CODE["sync"], native.split(";", 1)[0]
    if python:
        texts = python.split(";")
        frames = [python_frame(f) for f in texts]
        loading = [i for i, f in enumerate(frames) if _is_loading(f)]
        if loading:
            own = [i for i in loading if not LIBRARY_FILE.search(str(frames[i]["file"]))]
            return HOST_LABEL_CODE["loading"], texts[(own or loading)[0]]
        return HOST_LABEL_CODE["compute"], texts[frames.index(_own_first(frames))]
    leaf = native.split(";", 1)[0]
    code = "loading" if leaf and DATA_LOADING_FUNCTION.search(leaf) else "unknown" if traced_python else "compute"
    return HOST_LABEL_CODE[code], leaf


def host_labels(oncpu: pd.DataFrame, stacks: pd.DataFrame, pystacks: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per on-CPU sample (trace frame with ustack_id, pystack_id where recorded): its host
    label code (HOST_LABELS) and the frame text that names its function ("" unknown);
    each distinct pair of stacks is looked at once."""
    n = len(oncpu)
    uid = as_int64(oncpu["ustack_id"]) if "ustack_id" in oncpu else np.full(n, -1, np.int64)
    pid = as_int64(oncpu["pystack_id"]) if "pystack_id" in oncpu else np.full(n, -1, np.int64)
    sync = stack_class_codes(stacks, uid) == CLASS_CODE["gpu_sync"]
    keys = pd.MultiIndex.from_arrays([uid, pid, sync])
    index, uniq = keys.factorize()
    native = dict(zip(stacks["stack_id"].to_numpy(np.int64), stacks["frames"])) if len(stacks) else {}
    python = dict(zip(pystacks["stack_id"].to_numpy(np.int64), pystacks["frames"])) if len(pystacks) else {}
    found = [_label(python.get(int(p), ""), native.get(int(u), ""), bool(s), bool(python)) for u, p, s in uniq]
    if not n:
        return np.zeros(0, np.int8), np.zeros(0, object)
    return np.array([f[0] for f in found], dtype=np.int8)[index], np.array([f[1] for f in found], dtype=object)[index]


class HostSplit:
    """How a thread's ordinary user running time divides between HOST_LABELS (never
    `unknown`), by its on-CPU samples of class "user" with a known label (samples:
    attribution.SAMPLE_COLUMNS + `host`): the samples inside a stretch when there are
    some, the thread's overall mix otherwise, and all `compute` for a thread without
    such samples."""

    def __init__(self, samples: pd.DataFrame):
        self._by_tid: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if "host" not in samples or not len(samples):
            return
        label = samples["host"].to_numpy(np.int64)
        user = (samples["cls"] == "user").to_numpy() & (label != HOST_LABEL_CODE["unknown"])
        k = len(HOST_LABELS)
        for tid, idx in samples[user].groupby("tid").indices.items():
            rows = np.flatnonzero(user)[idx]
            onehot = np.zeros((len(rows) + 1, k), dtype=np.int64)
            onehot[np.arange(1, len(rows) + 1), label[rows]] = 1
            self._by_tid[int(tid)] = (samples["ts_ns"].to_numpy(np.int64)[rows], np.cumsum(onehot, axis=0))

    def fractions(self, tid: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(len(a), len(HOST_LABELS)) shares of the user running time in each [a, b)."""
        out = np.zeros((len(a), len(HOST_LABELS)))
        out[:, HOST_LABEL_CODE["compute"]] = 1.0
        if tid not in self._by_tid:
            return out
        ts, cum = self._by_tid[tid]
        counts = cum[np.searchsorted(ts, b, side="left")] - cum[np.searchsorted(ts, a, side="left")]
        total = counts.sum(axis=1, keepdims=True)
        overall = cum[-1] / max(1, cum[-1].sum())
        return np.where(total > 0, counts / np.maximum(total, 1), overall[None, :])


def _trainer_samples(ctx: ev.EvidenceContext, tid: int, label: str) -> pd.DataFrame:
    s = ctx.samples
    if s is None or "host" not in s or not len(s):
        return pd.DataFrame({"ts_ns": np.zeros(0, np.int64), "frame": np.zeros(0, object)})
    keep = ((s["tid"].to_numpy(np.int64) == tid) & (s["cls"] == "user").to_numpy()
            & (s["host"].to_numpy() == HOST_LABEL_CODE[label]))
    return pd.DataFrame({"ts_ns": s["ts_ns"].to_numpy(np.int64)[keep],
                         "frame": np.asarray(s["host_frame"], dtype=object)[keep]})


def functions(ctx: ev.EvidenceContext, own: pd.DataFrame, tid: int, label: str) -> list[dict[str, Any]]:
    """The functions the host-bound pieces `own` (findings.ATTRIBUTED_COLUMNS, the
    trainer's running pieces of `label`) went to, most seconds first: each piece's time
    shared among its samples of that label, pieces without one in proportion to the rest."""
    samples = _trainer_samples(ctx, tid, label)
    total = float(own["ns"].sum())
    if not len(samples) or total <= 0:
        return []
    own = own.sort_values("start_ns", kind="stable")
    ts = samples["ts_ns"].to_numpy()
    lo = np.searchsorted(ts, own["start_ns"].to_numpy(np.int64), side="left")
    hi = np.searchsorted(ts, own["end_ns"].to_numpy(np.int64), side="left")
    count = np.maximum(hi - lo, 0)
    piece = np.repeat(np.arange(len(own)), count)
    sample = np.repeat(lo, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    if not len(sample):
        return []
    weight = own["ns"].to_numpy(np.float64)[piece] / count[piece]
    per = pd.Series(weight).groupby(samples["frame"].to_numpy()[sample]).sum()
    per = per[per.index != ""].sort_values(ascending=False) * (total / per.sum())
    return [{**python_frame(str(name)), "seconds": float(ns) / NS_PER_S} for name, ns in per.iloc[:MAX_FUNCTIONS].items()]


def kernel_share(ctx: ev.EvidenceContext, own: pd.DataFrame, tid: int) -> dict[str, Any]:
    """How much of the trainer's running stretches that held the pieces `own` the kernel
    took: seconds in its fault, reclaim and mapping paths (by the samples inside them),
    seconds preempted right after them (runnable), its faults in the window, and the
    share of its samples on a NUMA node other than the GPU's."""
    ts = ctx.trainer_states
    rows = np.unique(own["interval"].to_numpy(np.int64))
    start, end = ts["start_ns"].to_numpy(np.int64)[rows], ts["end_ns"].to_numpy(np.int64)[rows]
    span_ns = float(clipped(start, end, ctx.window).sum())
    s = ctx.samples if ctx.samples is not None else pd.DataFrame({"tid": [], "ts_ns": [], "cls": []})
    mine = s[(s["tid"].to_numpy(np.int64) == tid)]
    at = np.searchsorted(start, mine["ts_ns"].to_numpy(np.int64), side="right") - 1
    inside = (at >= 0) & (mine["ts_ns"].to_numpy(np.int64) < end[np.maximum(at, 0)]) if len(start) else np.zeros(len(mine), bool)
    by_cls = mine["cls"].astype(str)[inside].value_counts()
    n = max(1, int(by_cls.sum()))
    in_kernel = {str(c): span_ns * int(k) / n / NS_PER_S for c, k in by_cls.items() if c != "user" and k}
    after = rows + 1
    after = after[after < len(ts)]
    preempted = after[codes(ts["state"])[after] == STATE_CODE["runnable"]]
    runq = clipped(ts["start_ns"].to_numpy(np.int64)[preempted], ts["end_ns"].to_numpy(np.int64)[preempted], ctx.window)
    faults = ctx.rows("faults", [tid])
    pl = ctx.placement
    remote = pl.loc[pl["tid"] == tid, "remote_fraction"] if len(pl) else pd.Series(dtype=float)
    return {
        "on_cpu_s": span_ns / NS_PER_S,
        "kernel_paths_s": in_kernel,
        "preempted_s": float(runq.sum()) / NS_PER_S,
        "faults": int(np.maximum(as_int64(faults["faults"], 0), 0).sum()) if len(faults) else 0,
        "remote_numa_share": float(remote.iloc[0]) if len(remote) else None,
    }


def _own_pieces(pieces: pd.DataFrame) -> pd.DataFrame:
    """The trainer's own host-bound running pieces (not shared out down a chain)."""
    return pieces[((pieces["state"] == "running").to_numpy()) & (pieces["end"].to_numpy() < 0)]


def input_pipeline(ctx: ev.EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    """ev.input_pipeline, and where the trainer loaded data itself: how long, where, and
    how many data-loader threads the trace holds."""
    out = ev.input_pipeline(ctx, pieces, roots)
    own = _own_pieces(pieces)
    if len(own):
        tid = int(own["root_tid"].iloc[0])
        out["trainer_loading"] = {
            "seconds": float(own["ns"].sum()) / NS_PER_S,
            "functions": functions(ctx, own, tid, "loading"),
            "dataloader_threads": int((ctx.threads["role"].astype(str) == "dataloader").sum()),
            **kernel_share(ctx, own, tid),
        }
    return out


def host_compute(ctx: ev.EvidenceContext, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    own = _own_pieces(pieces)
    if not len(own):
        return {"functions": []}
    tid = int(own["root_tid"].iloc[0])
    return {"functions": functions(ctx, own, tid, "compute"), **kernel_share(ctx, own, tid),
            "hardware_counters": None}
