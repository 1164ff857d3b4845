"""Malformed traces and documents: whatever the metadata or the columns hold, analyze,
export and the health check's reading end with the project's one-line error or a
report, never a traceback (issue 15, M1-M5 and the fuzz acceptance item)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from trainbpf.cli import app
from trainbpf.trace.errors import TrainbpfError
from trainbpf.trace.schema import COLUMNS, METADATA_KEY, TRACE_SCHEMA

DATA = Path(__file__).with_name("data") / "small-trace.parquet"
SMALL = pq.read_table(DATA)
META = json.loads(SMALL.schema.metadata[METADATA_KEY])
# A few rows of every kind: enough for each analyzer to run, quick to analyse.
SAMPLE = pa.concat_tables(
    SMALL.filter(pa.compute.equal(SMALL["kind"], kind)).slice(0, 40) for kind in set(SMALL["kind"].to_pylist()))
# The stored trace is a version-1 file: the columns added since are appended (null), so
# every column of today's schema can be crafted.
for _name in COLUMNS:
    if _name not in SAMPLE.column_names:
        SAMPLE = SAMPLE.append_column(TRACE_SCHEMA.field(_name), pa.nulls(SAMPLE.num_rows, TRACE_SCHEMA.field(_name).type))
EXIT_CODES = {0, 1, 2, 10, 11, 12, 13, 14, 15}


def write_trace(path: Path, table: pa.Table = SAMPLE, meta: Any = META) -> Path:
    raw = meta if isinstance(meta, bytes) else json.dumps(meta, allow_nan=True).encode()
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: raw}), path)
    return path


def run(*args: str):
    """The CLI in-process; returns (exit code, stderr lines).  A traceback fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's "invalid value" and kin
        res = CliRunner().invoke(app, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"trainbpf {' '.join(args)}: {type(res.exception).__name__}: {res.exception}") \
            from res.exception
    assert res.exit_code in EXIT_CODES, (res.exit_code, res.output)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("trainbpf: error:")]
    if res.exit_code:
        assert len(errors) == 1, res.output
    return res.exit_code, errors


def read_everything(path: Path, tmp: Path) -> list[int]:
    """analyze (text, json), export and the health check's node metrics over `path`."""
    codes = [run("analyze", str(path))[0], run("analyze", str(path), "--format", "json")[0],
             run("export", str(path), "-o", str(tmp / "out.json"))[0]]
    from trainbpf.analyzers.timeline.node import node_metrics
    from trainbpf.trace.reader import read_trace

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            node_metrics(read_trace(path))
    except TrainbpfError:
        pass
    return codes


# -- M1: malformed metadata -------------------------------------------------------------

CLOCK = META["clock"]
BAD_METADATA = {
    "a list": [1, 2],
    "a string": "trainbpf.trace/1",
    "clock start a string": {**META, "clock": {**CLOCK, "start_mono_ns": "soon"}},
    "clock end a string": {**META, "clock": {**CLOCK, "end_mono_ns": "later"}},
    "clock overflows int64": {**META, "clock": {**CLOCK, "end_mono_ns": 10**30}},
    "clock a huge float": {**META, "clock": {**CLOCK, "end_mono_ns": 1e300}},
    "target_pid one": {**META, "target_pid": "one"},
    "trainer_tid [1]": {**META, "trainer_tid": [1]},
    "job a list": {**META, "job": [0, 2]},
    "job.target_rank a string": {**META, "job": {"target_rank": "0", "world_size": 2}},
    "job.world_size negative": {**META, "job": {"target_rank": 0, "world_size": -2}},
    "topology.nodes a string": {**META, "topology": {**META["topology"], "nodes": "0-1"}},
    "end before start": {**META, "clock": {**CLOCK, "end_mono_ns": CLOCK["start_mono_ns"] - 10**9}},
    "python_frames a list": {**META, "python_frames": [True]},
    "python_frames.processes a list": {**META, "python_frames": {"enabled": True, "processes": ["ok"]}},
    "python_frames status a number": {**META, "python_frames": {"enabled": True,
                                                                 "processes": {"1": {"version": "3.12", "status": 0}}}},
}


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_malformed_metadata_is_a_one_line_error(case, tmp_path):
    path = write_trace(tmp_path / "t.parquet", meta=BAD_METADATA[case])
    for args in (["analyze", str(path)], ["export", str(path), "-o", str(tmp_path / "o.json")]):
        code, errors = run(*args)
        assert code == 14, (case, errors)
        assert "corrupt trainbpf metadata" in errors[0]


def test_non_utf8_paths_in_analyze_export_and_recover(tmp_path):
    import os

    from synth import healthy

    folder = os.fsencode(tmp_path)
    name = os.fsdecode(folder + b"/tr\xff.parquet")  # the CLI gets such names as str
    Path(name).write_bytes(DATA.read_bytes())
    assert run("analyze", name) == (0, [])
    assert run("analyze", name, "--format", "html", "-o", os.fsdecode(folder + b"/r\xfe.html")) == (0, [])
    assert b"tr\\xff.parquet" in Path(os.fsdecode(folder + b"/r\xfe.html")).read_bytes()
    assert run("export", name, "-o", os.fsdecode(folder + b"/e\xfe.json")) == (0, [])
    synth = healthy(2.0)
    spool = os.fsdecode(folder + b"/s\xff.parquet.spool")
    synth.write_spool(Path(spool[: -len(".spool")]))
    assert run("analyze", spool)[0] == 0
    assert run("recover", spool) == (0, [])
    assert Path(spool[: -len(".spool")]).exists()


# -- the fuzz test: metadata and every column type -----------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
META_PATHS = [("clock", k) for k in CLOCK] + [(k,) for k in META] + [
    ("topology", "nodes"), ("topology", "gpus"), ("topology", "gpu_node"), ("gpu", "processes"),
    ("gpu", "source"), ("lost", "sched"), ("stacks", "walks"), ("thresholds", "oncpu_hz")]


def _set(meta: dict, path: tuple[str, ...], value: Any) -> dict:
    meta = json.loads(json.dumps(meta))
    node = meta
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value
    return meta


ARROW_TYPES = [pa.string(), pa.int8(), pa.int32(), pa.int64(), pa.uint64(), pa.float64(), pa.bool_(), pa.null(),
               pa.list_(pa.int64()), pa.timestamp("ns"), pa.binary()]


@st.composite
def column_values(draw, typ: pa.DataType, n: int) -> pa.Array:
    if pa.types.is_null(typ):
        return pa.nulls(n)
    if pa.types.is_string(typ) or pa.types.is_binary(typ):
        values = draw(st.lists(st.none() | st.text(max_size=4), min_size=n, max_size=n))
        return pa.array(values if pa.types.is_string(typ) else [v.encode() if v else v for v in values], typ)
    if pa.types.is_boolean(typ):
        return pa.array(draw(st.lists(st.none() | st.booleans(), min_size=n, max_size=n)), typ)
    if pa.types.is_list(typ):
        return pa.array(draw(st.lists(st.none() | st.lists(st.integers(-5, 5), max_size=2), min_size=n, max_size=n)), typ)
    if pa.types.is_floating(typ):
        return pa.array(draw(st.lists(st.none() | st.floats(), min_size=n, max_size=n)), typ)
    if pa.types.is_timestamp(typ):
        return pa.array(draw(st.lists(st.none() | st.integers(0, 2**62), min_size=n, max_size=n)), typ)
    info = {pa.int8(): (-128, 127), pa.int32(): (-2**31, 2**31 - 1), pa.uint64(): (0, 2**64 - 1)}.get(typ, (-2**63, 2**63 - 1))
    return pa.array(draw(st.lists(st.none() | st.integers(*info), min_size=n, max_size=n)), typ)


@st.composite
def crafted_traces(draw):
    """The sample trace with some metadata values replaced by arbitrary JSON, some
    columns given another type, and some columns' rows (a few, or all) replaced."""
    meta = META
    for path in draw(st.lists(st.sampled_from(META_PATHS), max_size=3)):
        meta = _set(meta, path, draw(json_values))
    table = SAMPLE
    for name in draw(st.lists(st.sampled_from(COLUMNS), max_size=3, unique=True)):
        typ = draw(st.sampled_from([TRACE_SCHEMA.field(name).type] + ARROW_TYPES))
        n = draw(st.integers(1, 12))
        new = draw(column_values(typ, n))
        old = table[name]
        if old.type == new.type and draw(st.booleans()):  # a few rows changed, the rest kept
            start = draw(st.integers(0, table.num_rows - n))
            new = pa.concat_arrays([old.slice(0, start).combine_chunks(), new,
                                    old.slice(start + n).combine_chunks()])
        else:  # the whole column: the new values repeated
            new = pa.concat_arrays([new] * math.ceil(table.num_rows / n)).slice(0, table.num_rows)
        table = table.set_column(table.schema.get_field_index(name), name, new)
    return meta, table


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(crafted=crafted_traces())
def test_no_crafted_trace_makes_a_traceback(crafted, tmp_path):
    meta, table = crafted
    read_everything(write_trace(tmp_path / "t.parquet", table, meta), tmp_path)
