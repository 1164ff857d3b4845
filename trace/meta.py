"""The trace's metadata document (docs/trace-format.md, "Metadata"): written as JSON
under the Parquet / Arrow key ``trainbpf``, checked when read, and completed from the
rows for a spool that never finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.trace.documents import TooDeep, load_json
from trainbpf.trace.errors import TraceReadError, TraceSchemaError
from trainbpf.trace.schema import (
    METADATA_KEY,
    READABLE_VERSIONS,
    SCHEMA_ID,
    SCHEMA_NAME,
    SCHEMA_VERSION,
)


def meta_bytes(meta: Mapping[str, Any]) -> dict[bytes, bytes]:
    return {METADATA_KEY: json.dumps(meta, sort_keys=True, default=_json_default).encode()}


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")



# Metadata sections that are JSON objects, and those whose values are all integers
# (counters): checked when a trace is read, so a damaged trace is a one-line error, not
# a crash deep inside the analysis.
META_OBJECTS = ("clock", "topology", "thresholds", "gpu", "lost", "stacks", "python_frames", "job")
META_COUNTERS = ("lost", "stacks")
# The single values the analysis computes with: clock instants (nanoseconds, int64) and
# thread ids (kernel pids, int32); each may be absent or null.
META_INSTANTS = ("start_mono_ns", "end_mono_ns", "wall_minus_mono_ns")
META_IDS = ("target_pid", "trainer_tid")
META_JOB = ("target_rank", "world_size")  # the target's rank and its job's size: counts
INT64_MAX = 2**63 - 1
PID_MAX = 2**31 - 1  # tid/pid columns are int32


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _check_meta_shape(meta: Any, path: Path) -> None:
    def corrupt(what: str) -> TraceReadError:
        return TraceReadError(f"{path}: corrupt trainbpf metadata: {what}")

    if not isinstance(meta, dict):
        raise corrupt(f"a JSON {type(meta).__name__}, not an object")
    for key in META_OBJECTS:
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise corrupt(f"{key!r} is not an object")
    for key in META_COUNTERS:
        for name, value in (meta.get(key) or {}).items():
            if not _is_int(value, -INT64_MAX, INT64_MAX):
                raise corrupt(f"{key}.{name} is not an integer")
    clock = meta.get("clock") or {}
    for key in META_INSTANTS:
        if clock.get(key) is not None and not _is_int(clock[key], -INT64_MAX, INT64_MAX):
            raise corrupt(f"clock.{key} is not a 64-bit integer of nanoseconds")
    start, end = clock.get("start_mono_ns"), clock.get("end_mono_ns")
    if start is not None and end is not None and end < start:
        raise corrupt("clock.end_mono_ns is before clock.start_mono_ns (a negative duration)")
    for key in META_IDS:
        if meta.get(key) is not None and not _is_int(meta[key], 0, PID_MAX):
            raise corrupt(f"{key} is not a process id")
    for key in META_JOB:
        if (meta.get("job") or {}).get(key) is not None and not _is_int(meta["job"][key], 0, PID_MAX):
            raise corrupt(f"job.{key} is not a non-negative integer")
    topology = meta.get("topology") or {}
    nodes = topology.get("nodes")
    if nodes is not None and not (isinstance(nodes, dict) and all(
            str(n).isdigit() and isinstance(cpus, list) and all(_is_int(c, 0, PID_MAX) for c in cpus)
            for n, cpus in nodes.items())):
        raise corrupt('topology.nodes is not {"NODE": [cpus]}')
    if topology.get("gpu_node") is not None and not _is_int(topology["gpu_node"], 0, PID_MAX):
        raise corrupt("topology.gpu_node is not a node number")
    processes = (meta.get("gpu") or {}).get("processes")
    if processes is not None and not (isinstance(processes, list) and all(isinstance(p, dict) for p in processes)):
        raise corrupt("gpu.processes is not a list of objects")
    statuses = (meta.get("python_frames") or {}).get("processes")
    if statuses is not None and not (isinstance(statuses, dict) and all(
            isinstance(s, dict) and isinstance(s.get("status"), str) for s in statuses.values())):
        raise corrupt('python_frames.processes is not {"PID": {"version", "status"}}')


def decode_meta(raw: Mapping[bytes, bytes] | None, path: Path) -> dict[str, Any]:
    if not raw or METADATA_KEY not in raw:
        raise TraceReadError(f"{path}: not a trainbpf trace (no trainbpf metadata)")
    try:
        meta = load_json(raw[METADATA_KEY])
    except TooDeep as exc:
        raise TraceReadError(f"{path}: corrupt trainbpf metadata ({exc})") from None
    except ValueError as exc:
        raise TraceReadError(f"{path}: corrupt trainbpf metadata") from exc
    if not isinstance(meta, dict):
        _check_meta_shape(meta, path)
    schema = str(meta.get("schema", ""))
    name, _, version = schema.partition("/")
    if name != SCHEMA_NAME:
        raise TraceSchemaError(f"{path}: unknown trace schema {schema!r}, expected {SCHEMA_ID}")
    if not version.isdigit() or int(version) not in READABLE_VERSIONS:
        newer = version.isdigit() and int(version) > SCHEMA_VERSION
        hint = "upgrade trainbpf to read it" if newer else "re-record it with this version"
        raise TraceSchemaError(f"{path}: trace schema {schema} is not {SCHEMA_ID}; {hint}")
    _check_meta_shape(meta, path)
    return meta


def derive_final_meta(rows: pa.Table | Iterable[pa.RecordBatch], meta: dict[str, Any]) -> dict[str, Any]:
    """Fill what only the end of a recording knows from the rows, for recovered spools.
    `rows`: a table, or batches read one at a time."""
    meta = dict(meta)
    counts: dict[str, int] = dict(meta.get("lost") or {})
    lost: dict[str, int] = {}  # newest (largest) cumulative count per probe
    end: int | None = None
    segment: int | None = None  # the newest segment's clock
    any_rows = False
    for batch in rows.to_batches() if isinstance(rows, pa.Table) else rows:
        if not batch.num_rows:
            continue
        any_rows = True
        segments = pc.max(batch.filter(pc.equal(batch.column("kind"), "segment")).column("ts_ns")).as_py()
        if segments is not None:
            segment = segments if segment is None else max(segment, segments)
        lost_rows = batch.filter(pc.equal(batch.column("kind"), "lost"))
        for name, count in zip(lost_rows.column("name").to_pylist(), lost_rows.column("count").to_pylist()):
            if count is not None:
                lost[name] = max(lost.get(name, count), count)
        ends = pc.max(pc.add(batch.column("ts_ns"), pc.fill_null(batch.column("dur_ns"), 0))).as_py()
        if ends is not None:
            end = ends if end is None else max(end, ends)
    counts.update(lost)
    meta["lost"] = counts
    clock = dict(meta.get("clock") or {})
    if not clock.get("end_mono_ns") and any_rows:
        # A killed recording ends at its last segment; a spool of a version without
        # segment rows, at its last row.
        clock["end_mono_ns"] = int(segment or end or clock.get("start_mono_ns", 0))
    meta["clock"] = clock
    return meta
