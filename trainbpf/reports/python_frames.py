"""How the reports show a finding's Python frames (evidence `python_frames`,
analyzers/findings/python_ends.py): one line naming the frame each end was in,

    trainer 100: train.py:54 train_step ← dataloader 200: data.py:31 decode_batch

The frame shown for an end is its leaf-most frame in the program's own code: frames of
the standard library and of installed packages (`threading.py` `wait`, a DataLoader's
`_worker_loop`) say how it waited, not where; an end with only such frames shows its
leaf frame.  The JSON evidence keeps every frame.
"""

from __future__ import annotations

import posixpath
from typing import Any

from trainbpf.analyzers.causes.stack_reading import LIBRARY_FILE


def frame_label(frame: dict[str, Any]) -> str:
    """"data.py:31 decode_batch": the file's base name, the line, the function."""
    name = posixpath.basename(str(frame.get("file") or "")) or "?"
    return f"{name}:{frame.get('line', 0)} {frame.get('function') or '?'}"


def shown_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The frame a report names for an end (leaf first `frames`): the leaf-most one not
    in library code, else the leaf; None without frames."""
    if not frames:
        return None
    return next((f for f in frames if not LIBRARY_FILE.search(str(f.get("file") or ""))), frames[0])


def python_line(finding: dict[str, Any]) -> str | None:
    """A finding's (JSON document form) Python frames as one line, waiter first; None
    when its evidence names none."""
    frames = (finding.get("evidence") or {}).get("python_frames") or {}
    waiter, producer = shown_frame(frames.get("waiter") or []), shown_frame(frames.get("producer") or [])
    # A job's chain starts at the rank that waited in a collective: the frames are the
    # late rank's.
    chain = [link for link in finding.get("chain") or [] if link.get("state") != "collective"]
    if (waiter is None and producer is None) or not chain:
        return None
    ends = [(chain[0], waiter)]
    if len(chain) > 1 and producer is not None:
        ends.append((chain[-1], producer))
    return " ← ".join(f"{link['role']} {link['tid']}: {frame_label(frame) if frame else '?'}" for link, frame in ends)


def refused_note(meta: dict[str, Any]) -> str | None:
    """A note naming the CPython processes whose frames were not walked (trace metadata
    `python_frames`: the layout failed its self-test, or the version has no table), so
    a report without Python frames says why; None when every CPython was walked."""
    info = meta.get("python_frames") or {}
    refused = [(pid, p) for pid, p in (info.get("processes") or {}).items()
               if p.get("version") and p.get("status") != "ok"]
    if not info.get("enabled") or not refused:
        return None
    pid, first = refused[0]
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return (f"NOTE: Python frames were not walked in process {pid}{more}: {first['status']}; "
            "its stacks are native only.")
