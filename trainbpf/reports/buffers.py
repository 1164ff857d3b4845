"""The buffer lifetime table (analyzers/causes/lifetimes.py): the JSON `buffers` section,
its text lines and its HTML table, with the CUDA frees held back by events
(analyzers/causes/held_frees.py); and a freed-late finding's culprits, the threads that
map and unmap the held buffers."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from trainbpf.analyzers.causes.freed_late import held_back_text
from trainbpf.analyzers.causes.lifetimes import class_label
from trainbpf.reports.html_timeline import esc

# Size classes the report lists at most, largest first.
MAX_CLASSES = 8
# Held-back events the report lists at most, the most frees first.
MAX_EVENTS = 5
# The table is shown when a size class has at least this many buffers: one large
# mapping held for the whole run is no churn.
SHOWN_MIN_BUFFERS = 3
# What the report advises where a free was held back by an event.
HELD_BACK_ADVICE = ("release each buffer at the step boundary after an explicit stream sync instead of polling its "
                    "event, and size the pool to the pipeline's depth (alive at once)")
# What each memory is called in the table.
MEMORY_LABELS = {"mapped": "mapped", "cuda_device": "CUDA device", "cuda_host": "CUDA pinned host"}


def _number(value: Any) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 6)


def buffers_section(lifetimes: Any, held: Any = None) -> dict[str, Any] | None:
    """The report's `buffers` section: `unit` "steps" (the trainer's CUDA steps or the
    GPU's busy periods) or "seconds", and per memory ("mapped", "cuda_device",
    "cuda_host") and size class (largest first) buffers mapped and freed, alive at
    once (median, max), lifetime, maps and faults a step or a second, the threads that
    mapped and unmapped most; `held_back`: the CUDA frees held back by events
    (freed_late.HELD_BACK_COLUMNS rows); None without either."""
    has_held = held is not None and len(held) > 0
    if (lifetimes is None or not len(lifetimes)) and not has_held:
        return None
    if lifetimes is None:
        lifetimes = pd.DataFrame(columns=["lifetime_steps"])
    in_steps = bool(lifetimes["lifetime_steps"].notna().any())
    return {"unit": "steps" if in_steps else "seconds", "held_back": _held_rows(held) if has_held else [],
            "size_classes": [{
        "memory": str(r.memory), "size_class_bytes": int(r.size_class), "buffers": int(r.buffers), "freed": int(r.freed),
        "alive_at_once": float(r.alive_at_once), "alive_max": int(r.alive_max),
        "lifetime_s": _number(r.lifetime_s), "lifetime_steps": _number(r.lifetime_steps),
        "maps_per_step": _number(r.maps_per_step), "faults_per_step": _number(r.faults_per_step),
        "faults_per_s": _number(r.faults_per_s), "map_tid": int(r.map_tid),
        "unmap_tid": int(r.unmap_tid) if r.unmap_tid >= 0 else None,
    } for r in lifetimes.head(MAX_CLASSES).itertuples(index=False)]}


def _held_rows(held: pd.DataFrame) -> list[dict[str, Any]]:
    return [{"pid": int(r.pid), "tid": int(r.tid), "comm": str(r.comm), "function": str(r.function),
             "memory": str(r.memory), "event": int(r.event), "stream": int(r.stream), "frees": int(r.frees),
             "queries": int(r.queries), "waits": int(r.waits), "held_ms": float(r.held_ms)}
            for r in held.head(MAX_EVENTS).itertuples(index=False)]


def _shown(section: dict[str, Any] | None) -> bool:
    """Whether the text and HTML show the table: a size class with several buffers, or
    a free held back."""
    return bool(section) and (bool(section.get("held_back")) or any(
        c["buffers"] >= SHOWN_MIN_BUFFERS for c in section["size_classes"]))


def _cells(section: dict[str, Any], c: dict[str, Any]) -> tuple[str, ...]:
    steps = section["unit"] == "steps"
    life = c["lifetime_steps"] if steps else c["lifetime_s"]
    faults = c["faults_per_step"] if steps else c["faults_per_s"]
    return (MEMORY_LABELS.get(c["memory"], c["memory"]), class_label(c["size_class_bytes"]), f"{c['buffers']} ({c['freed']} freed)",
            f"{c['alive_at_once']:g} (max {c['alive_max']})", "-" if life is None else f"{life:.3g}",
            f"{faults:,.0f}", str(c["map_tid"]), "-" if c["unmap_tid"] is None else str(c["unmap_tid"]))


def _headings(section: dict[str, Any]) -> tuple[str, ...]:
    unit = "step" if section["unit"] == "steps" else "s"
    return ("memory", "size class", "buffers", "alive at once", f"lifetime ({'steps' if unit == 'step' else 's'})",
            f"faults / {unit}", "mapped by", "unmapped by")


def buffer_lines(report: dict[str, Any]) -> list[str]:
    """The lifetime table as text lines, and the frees held back by events; nothing
    unless a size class has several buffers or a free was held back."""
    section = report.get("buffers")
    if not _shown(section):
        return []
    rows = [_headings(section)] + [_cells(section, c) for c in section["size_classes"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["", "Buffer lifetimes (mappings paired with their unmappings, per size class):"] + [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows] + [
        f"  CUDA {held_back_text(e)}" for e in section.get("held_back") or []] + (
        [f"  do: {HELD_BACK_ADVICE}"] if section.get("held_back") else [])


def buffer_html(report: dict[str, Any]) -> list[str]:
    """The lifetime table's heading and HTML table, and the frees held back by events;
    nothing unless the text shows them."""
    section = report.get("buffers")
    if not _shown(section):
        return []
    head = "".join(f"<th>{esc(h)}</th>" for h in _headings(section))
    rows = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in _cells(section, c)) + "</tr>"
                   for c in section["size_classes"])
    held = "".join(f"<li>CUDA {esc(held_back_text(e))}</li>" for e in section.get("held_back") or [])
    return ["<h2>Buffer lifetimes</h2>", f'<table class="num"><tr>{head}</tr>{rows}</table>'] + (
        [f"<ul>{held}</ul>", f"<p>Do: {esc(HELD_BACK_ADVICE)}.</p>"] if held else [])


def buffer_culprits(rows: list[dict[str, Any]], evidence: dict[str, Any], pids: Any) -> list[dict[str, Any]]:
    """`rows` (a finding's culprits) with a freed-late finding's mapping and unmapping
    threads marked (`mapper`/`unmapper`: true, with the function they ran most in the
    mapping paths), added where not named already (as `holder`s of the buffers, like a
    lock's holders)."""
    if evidence.get("case") != "freed_late":
        return rows
    threads = {int(r["tid"]): r for r in rows if r["kind"] == "thread"}
    for key in ("mapper", "unmapper"):
        t = evidence.get(key)
        if not t:
            continue
        tid = int(t["tid"])
        if tid not in threads:
            threads[tid] = {"kind": "thread", "name": t["comm"] or "?", "tid": tid, "pid": pids.get(tid),
                            "holder": True}
            rows.append(threads[tid])
        threads[tid][key] = True
        if t["function"]:
            threads[tid].setdefault("function", t["function"])
    return rows
