"""Hostile or absurd inputs, round 2 (issue 34, items 6, 7 and 10): deeply nested
metadata, spools of a foreign schema, a trace too large for the memory available, and
names that would drive the terminal.  Each ends with the project's one-line error, or a
report, never a traceback, a hang or an allocation failure."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from synth import input_pipeline
from test_malformed import run, write_trace
from trainbpf.trace.schema import METADATA_KEY, SCHEMA_ID, TRACE_SCHEMA, V2_COLUMNS

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))


# -- item 6: deeply nested metadata ----------------------------------------------------

def test_deeply_nested_metadata_is_a_one_line_error(tmp_path):
    """json.loads recurses once per level: 100,000 levels were a RecursionError."""
    raw = b'{"schema": "' + SCHEMA_ID.encode() + b'", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = write_trace(tmp_path / "t.parquet", meta=raw)
    for args in (["analyze", str(path)], ["export", str(path), "-o", str(tmp_path / "o.json")]):
        code, errors = run(*args)
        assert code == 14, errors
        assert errors[0].endswith("corrupt trainbpf metadata (nested deeper than 64 levels)"), errors


# -- item 6: spools of a foreign schema ------------------------------------------------

def _spool(tmp_path: Path, change) -> Path:
    """A recorder's spool (killed before finalising) rewritten with `change(table)`'s
    columns under the same metadata."""
    spool = input_pipeline(2.0).write_spool(tmp_path / "t.parquet")
    with ipc.open_stream(pa.OSFile(str(spool))) as reader:
        meta, table = reader.schema.metadata, reader.read_all()
    table = change(table).replace_schema_metadata(meta)
    with ipc.new_stream(str(spool), table.schema) as writer:
        writer.write_table(table)
    return spool


FOREIGN_SPOOLS = {
    "an extra column": (lambda t: t.append_column("extra", pa.array([1] * t.num_rows)), "unknown column extra"),
    "a missing column": (lambda t: t.drop_columns(["tid"]), "no column tid"),
    "ts_ns as strings": (lambda t: t.set_column(t.schema.get_field_index("ts_ns"), "ts_ns", t["ts_ns"].cast(pa.string())),
                         "column ts_ns holds string, expected int64"),
    "columns reordered": (lambda t: t.select(list(reversed(t.column_names))), "columns repeated or out of order"),
}


@pytest.mark.parametrize("case", sorted(FOREIGN_SPOOLS))
def test_a_spool_of_a_foreign_schema_is_a_one_line_error(case, tmp_path):
    change, words = FOREIGN_SPOOLS[case]
    spool = _spool(tmp_path, change)
    for args in (["analyze", str(spool)], ["recover", str(spool), "-o", str(tmp_path / "r.parquet")]):
        code, errors = run(*args)
        assert code == 14, (case, errors)
        assert errors[0] == f"trainbpf: error: {spool}: not a trainbpf spool ({words})", errors
    assert not (tmp_path / "r.parquet").exists()


def test_an_older_spool_without_the_v2_columns_is_still_read(tmp_path):
    spool = _spool(tmp_path, lambda t: t.drop_columns(list(V2_COLUMNS)))
    assert run("analyze", str(spool)) == (0, [])
    assert run("recover", str(spool)) == (0, [])


# -- item 7: a trace too large for the memory available ---------------------------------

def _many_rows(path: Path, groups: int) -> Path:
    """`groups` row groups of 2**20 identical off-CPU rows: ~55 KB each on disk, written
    in a fraction of a second each."""
    n = 1 << 20
    columns = []
    for field in TRACE_SCHEMA:
        if field.name == "kind":
            columns.append(pa.array(["offcpu"]).take(pa.array([0] * n)))
        elif field.name in ("ts_ns", "dur_ns", "tid", "pid"):
            columns.append(pa.array([1] * n, field.type))
        else:
            columns.append(pa.nulls(n, field.type))
    table = pa.Table.from_arrays(columns, schema=TRACE_SCHEMA)
    meta = {"schema": SCHEMA_ID, "clock": {"start_mono_ns": 0, "end_mono_ns": 10**9}, "target_pid": 1}
    with pq.ParquetWriter(path, TRACE_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta).encode()})) as writer:
        for _ in range(groups):
            writer.write_table(table)
    return path


ADDRESS_SPACE = 3 << 30  # `ulimit -v`: room for the program (~1.9 GB mapped) and little more


def test_a_trace_too_large_for_memory_is_refused_before_reading(tmp_path):
    """42M rows in 2.3 MB under a 3 GiB address-space limit: refused from the footer's
    row count at once, in little memory, where the analysis grew until an allocation
    failed (reported as a corrupt file)."""
    start = time.monotonic()
    path = _many_rows(tmp_path / "big.parquet", 40)
    assert time.monotonic() - start < 30 and path.stat().st_size < 10 << 20
    wrapper = ("import resource, subprocess, sys, time\n"
               f"resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE}))\n"
               "start = time.monotonic()\n"
               "res = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
               "print(res.returncode, time.monotonic() - start, peak, res.stderr.strip(), sep='\\n')\n")
    for command in ("analyze", "export"):
        out = subprocess.run([sys.executable, "-c", wrapper, TRAINBPF, command, str(path), "-o", str(tmp_path / "o")],
                             capture_output=True, text=True, timeout=300).stdout.split("\n", 3)
        code, seconds, peak_kib, stderr = int(out[0]), float(out[1]), int(out[2]), out[3].strip()
        assert code == 14 and len(stderr.splitlines()) == 1, stderr
        assert f"{path}: analysing its 41,943,040 rows needs about 7.8 GiB of memory and " in stderr, stderr
        assert stderr.endswith("give --no-memory-check to try anyway"), stderr
        assert seconds < 20, seconds
        assert peak_kib < 400 << 10, f"{peak_kib >> 10} MiB"
        assert not (tmp_path / "o").exists()


def test_memory_available_is_the_least_of_meminfo_cgroup_and_rlimit(tmp_path, monkeypatch):
    from trainbpf.trace import memory

    (tmp_path / "meminfo").write_text("MemTotal: 8000000 kB\nMemFree: 100 kB\nMemAvailable: 4000000 kB\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/job/step\n")
    (tmp_path / "self" / "status").write_text("VmSize: 1000 kB\nVmData: 500 kB\n")
    for folder, limit, usage in (("job", "3000000000", "1000000000"), ("job/step", "max", "900000000")):
        (tmp_path / "cg" / folder).mkdir(parents=True)
        (tmp_path / "cg" / folder / "memory.max").write_text(limit + "\n")
        (tmp_path / "cg" / folder / "memory.current").write_text(usage + "\n")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory, "PROC_SELF", tmp_path / "self")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "cg")
    assert memory.available_bytes() == 2_000_000_000  # the job's 3 GB limit, 1 GB used
    (tmp_path / "cg" / "job" / "memory.max").write_text("max\n")
    assert memory.available_bytes() == 4_000_000_000 * 1024 // 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (1 << 40, hard))
    try:
        assert memory.available_bytes() == min(4_000_000_000 * 1024 // 1000, (1 << 40) - 500 * 1024)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


# -- item 10: names that would drive the terminal --------------------------------------

EVIL = "py\x1b]0;owned\x07\x1b[2J\u202e\x9bthon"


def test_thread_names_are_escaped_in_the_text_report(tmp_path):
    synth = input_pipeline(2.0)
    for row in synth.rows["thread"]:
        row["comm"] = EVIL
    path = synth.write(tmp_path / "t.parquet")
    res = subprocess.run([TRAINBPF, "analyze", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for raw in ("\x1b", "\x07", "\u202e", "\x9b"):
        assert raw not in res.stdout
    escaped = "py\\x1b]0;owned\\x07\\x1b[2J\\u202e\\x9bthon"
    assert f"threads: {escaped} (" in res.stdout and f"  {escaped}  " in res.stdout, res.stdout


def test_errors_quoting_a_name_are_escaped(tmp_path):
    name = tmp_path / "trace\x1b[2J\r.parquet"
    name.write_bytes(b"not a trace")
    res = subprocess.run([TRAINBPF, "analyze", str(name)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 14 and "\x1b" not in res.stderr and "\r" not in res.stderr, res.stderr
    assert res.stderr == f"trainbpf: error: {tmp_path}/trace\\x1b[2J\\x0d.parquet: not a Parquet trace file\n"
    assert os.path.exists(name)
