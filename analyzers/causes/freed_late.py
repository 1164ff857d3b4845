"""The `freed_late` case of allocator_churn (analyzers/causes/categories.py): batch-sized
buffers held several at once and mapped afresh each time, with the threads that map and
unmap them; and the CUDA events that held frees back (held_frees.py), named with the
freeing thread and its Python frame."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.held_frees import EVENT_COLUMNS, held_events
from trainbpf.analyzers.causes.lifetimes import class_label, held_class

if TYPE_CHECKING:
    from trainbpf.analyzers.causes.evidence import EvidenceContext

# Events a finding names at most.
MAX_EVENTS = 3
HELD_BACK_COLUMNS = EVENT_COLUMNS + ("comm", "function")


def freed_late(ctx: "EvidenceContext", roots: list[int]) -> dict[str, Any]:
    """The `freed_late` case: batch-sized buffers held several at once (lifetimes.held_class)
    and mapped afresh each time, with the threads that map and unmap them (and the Python
    frame each ran most in the fault and mapping paths); {} when no class is."""
    table = ctx.lifetimes
    row = held_class(table, roots) if table is not None and len(table) else None
    if row is None:
        return {}
    in_steps = not np.isnan(row["lifetime_steps"])
    held = {k: (None if isinstance(v, float) and np.isnan(v) else v.item() if hasattr(v, "item") else v)
            for k, v in row.items()}
    mapper, unmapper = _busiest_frame(ctx, held["map_tid"]), _busiest_frame(ctx, held["unmap_tid"])
    back = held_back(ctx, [held["unmap_tid"]])
    return {"case": "freed_late", "held_buffers": held, "mapper": mapper, "unmapper": unmapper,
            "held_back": back[:MAX_EVENTS], "names": {
        "size_class": class_label(held["size_class"]), "alive": f"{held['alive_at_once']:g}",
        "lifetime": f"{held['lifetime_steps']:g} steps" if in_steps else f"{held['lifetime_s']:.2f} s",
        "faults": f"{held['faults_per_step'] if in_steps else held['faults_per_s']:,.0f}",
        "per": "a step" if in_steps else "a second", "per_unit": "step" if in_steps else "second",
        "mapper": _thread_label(mapper), "unmapper": _thread_label(unmapper) if unmapper else "nobody",
        "held_back": f"; {held_back_text(back[0])}" if back else ""}}


# The on-CPU sample classes of a thread mapping, unmapping or faulting memory in.
_MAPPING_CLASSES = ("allocator_churn", "page_faults", "mmap_lock")


def _busiest_frame(ctx: "EvidenceContext", tid: int) -> dict[str, Any] | None:
    """Thread `tid` named, with the function (Python where recorded) it ran most in the
    mapping and fault paths, else in any of its samples ("" when none names one)."""
    if tid < 0:
        return None
    s, frame = ctx.samples, ""
    if s is not None and "host_frame" in s and len(s):
        mine = s[(s["tid"].to_numpy(np.int64) == tid) & (s["host_frame"].astype(str) != "").to_numpy()]
        paths = mine[mine["cls"].astype(str).isin(_MAPPING_CLASSES).to_numpy()]
        pick = paths if len(paths) else mine
        frame = str(pick["host_frame"].value_counts().idxmax()) if len(pick) else ""
    return {**ctx.thread(tid), "function": frame}


def _python_frame(ctx: "EvidenceContext", tid: int) -> dict[str, Any]:
    """Thread `tid` named, with the Python function it ran most where its samples have
    Python stacks, else the function _busiest_frame names."""
    s = ctx.samples
    if s is not None and "pystack_id" in s and "host_frame" in s and len(s):
        mine = s[(s["tid"].to_numpy(np.int64) == tid) & (s["pystack_id"].fillna(-1).to_numpy(np.int64) >= 0)
                 & (s["host_frame"].astype(str) != "").to_numpy()]
        if len(mine):
            return {**ctx.thread(tid), "function": str(mine["host_frame"].value_counts().idxmax())}
    return _busiest_frame(ctx, tid) or {**ctx.thread(tid), "function": ""}


def _thread_label(named: dict[str, Any]) -> str:
    label = f"{named['comm'] or 'thread'} ({named['tid']})"
    return f"{label} in {named['function']}" if named["function"] else label


def held_back_table(ctx: "EvidenceContext", tids: list[int] | None = None) -> pd.DataFrame:
    """HELD_BACK_COLUMNS: the window's CUDA frees held back by events
    (held_frees.held_events) of threads `tids` (None: every thread), each thread named
    with the function it ran most."""
    held = ctx.held_frees
    if held is None or not len(held):
        return pd.DataFrame(columns=list(HELD_BACK_COLUMNS))
    if tids is not None:
        held = held[held["tid"].isin(tids)]
    events = held_events(held)
    named = {int(t): _python_frame(ctx, int(t)) for t in events["tid"].unique()}
    return events.assign(comm=[named[int(t)]["comm"] for t in events["tid"]],
                         function=[named[int(t)]["function"] for t in events["tid"]])


def held_back(ctx: "EvidenceContext", tids: list[int] | None = None) -> list[dict[str, Any]]:
    """held_back_table as plain dicts, the most frees first."""
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in held_back_table(ctx, tids).to_dict("records")]


def held_back_text(e: dict[str, Any]) -> str:
    """One held-back event in words: "frees held back by event 0x5000 (recorded on stream
    0x5151): 6 queries over 31.2 ms before each of 40 frees, by tb_trainer (100) in
    step (/srv/train.py:12)"."""
    stream = f" (recorded on stream {e['stream']:#x})" if e["stream"] else ""
    waited = [f"{round(e['queries'] / e['frees']):g} queries" if e["queries"] else "",
              f"{round(e['waits'] / e['frees']):g} stream waits" if e["waits"] else ""]
    who = _thread_label({"tid": e["tid"], "comm": e["comm"], "function": e["function"]})
    return (f"frees held back by event {e['event']:#x}{stream}: {' and '.join(w for w in waited if w)} over "
            f"{e['held_ms']:.3g} ms before each of {e['frees']} frees, by {who}")
