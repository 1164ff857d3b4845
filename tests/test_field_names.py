"""One name per field from the probe's C struct to the trace's view: the C struct, the
collector and the analyzers say `bytes`; only schema.py knows the file stores it in the
shared column `size` (KIND_NAMES), and make_batch / Trace.view rename there."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kernel_env import require_root
from trainbpf.trace.schema import KIND_COLUMNS, view_columns
from trainbpf.trace.spool import make_batch

TRACER = Path(__file__).resolve().parent.parent / "tracer"

MM_KINDS = ("mmap_lock", "reclaim", "compaction", "numa_move", "numa_migrate", "mm_syscall")
# The kinds each probe's ring buffer records and drained maps become.
RECORD_KINDS = {
    "sched_events": ("offcpu",), "task_events": ("thread", "exit"), "futex_events": ("futex",),
    "oncpu_events": ("oncpu",), "mm_events": MM_KINDS, "writeback_events": ("dirty_pause",),
    "block_events": ("block_rq",), "cuda_events": ("cuda_call",), "nccl_events": ("collective",),
    "short_waits": ("offcpu_short",), "preemptions": ("preempted_by",), "cuda_launches": ("cuda_launch",),
    "net_events": ("socket",),
}
# Fields that are not a column of their rows: padding, a layer the call's name already
# says, the bucket a launch row's ts_ns and dur_ns are computed from, and the parts a
# socket's peer and interface are made of.
NOT_STORED = {"pad", "layer@cuda_events", "bucket@cuda_launches", "first_ns@cuda_launches",
              "port@net_events", "addr@net_events", "addr_len@net_events", "ifindex@net_events"}
# mm_events is one struct for six kinds of row: `what` says which, and its generic slots
# hold a different column of each (tracer/collectors/mm.py names them).
GENERIC = {"mm_events"}


def test_rows_are_given_under_their_view_names_and_stored_under_the_shared_columns():
    batch = make_batch("block_rq", {"ts_ns": [1], "dur_ns": [2], "tid": [3], "pid": [3], "bytes": [4096],
                                    "rwbs": ["WS"], "dev": [8388608], "sector": [2048]})
    row = pa.Table.from_batches([batch]).to_pylist()[0]
    assert (row["size"], row["name"], row["op"], row["addr"]) == (4096, "WS", 8388608, 2048)
    with pytest.raises(ValueError, match="block_rq rows have no column size"):
        make_batch("block_rq", {"size": [4096]})  # a storage name: the file's, not the writer's


def _row_columns(call: ast.Call) -> tuple[str, list[str]] | None:
    """(kind, column names) of a make_batch("kind", {"column": ...}) call written out."""
    if len(call.args) < 2 or not isinstance(call.args[0], ast.Constant) or not isinstance(call.args[1], ast.Dict):
        return None
    return call.args[0].value, [k.value for k in call.args[1].keys if isinstance(k, ast.Constant)]


def test_collectors_name_no_storage_column():
    """Every row the tracer writes is written under its kind's view names."""
    wrong = []
    for path in sorted(TRACER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "make_batch":
                found = _row_columns(node)
                if found and found[0] in KIND_COLUMNS:
                    kind, columns = found
                    wrong += [f"{path.name}:{node.lineno} {kind}.{c}" for c in columns if c not in view_columns(kind)]
    assert not wrong, f"columns that are not their kind's view names: {wrong}"


def _synthetic(dtype: np.dtype, n: int) -> np.ndarray:
    """`n` records of `dtype`, record i holding i in every integer field (a code, a count)."""
    records = np.zeros(n, dtype)
    for name in dtype.names:
        if records[name].ndim == 1 and records[name].dtype.kind in "iu":
            records[name] = np.arange(n)
    return records


@pytest.mark.kernel
def test_every_c_field_that_reaches_the_trace_has_its_view_name():
    """Load every probe; each field of the structs its ring buffers and drained maps carry
    (the dtypes the collectors decode with, from the C bcc parsed) is a view column of the
    rows it becomes; and each collector decodes its records into rows under those names."""
    require_root()
    from bcc.table import _get_event_class

    from trainbpf.tracer import loader
    from trainbpf.tracer.collector import ctypes_to_dtype
    from trainbpf.tracer.collectors import cuda, nccl
    from trainbpf.tracer.settings import Settings

    settings = Settings()
    collectors = loader.select(None, settings)
    bpf = loader.load(collectors, settings)
    try:
        structs = {rb: ctypes_to_dtype(_get_event_class(bpf[rb])) for c in collectors for rb in c.ringbufs}
        for table in ("short_waits", "preemptions", "cuda_launches"):
            key, leaf = ctypes_to_dtype(bpf[table].Key), ctypes_to_dtype(bpf[table].Leaf)
            structs[table] = np.dtype([(n, key.fields[n][0]) for n in key.names] + [(n, leaf.fields[n][0]) for n in leaf.names])
    finally:
        bpf.cleanup()
    assert set(structs) == set(RECORD_KINDS)
    misnamed = []
    for source, dtype in structs.items():
        if source in GENERIC:
            continue
        columns = {c for kind in RECORD_KINDS[source] for c in view_columns(kind)}
        misnamed += [f"{source}.{f}" for f in dtype.names
                     if f not in columns and f not in NOT_STORED and f"{f}@{source}" not in NOT_STORED]
    assert not misnamed, f"C fields named otherwise than their view column: {misnamed}"

    for c in collectors:
        for rb in c.ringbufs:
            records = _synthetic(structs[rb], 14)  # 14: every mm_events `what` code
            if "name" in structs[rb].names:  # a call's index into CALLS
                records["name"] %= len((cuda if c.name == "cuda" else nccl).CALLS)
            batches = c.decode(rb, records)
            kinds = {k for b in batches for k in b.column("kind").to_pylist()}
            assert batches and kinds <= set(RECORD_KINDS[rb]), (rb, kinds)
