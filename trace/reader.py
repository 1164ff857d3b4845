"""Reading trace files: ``read_trace`` opens a finished trace (Parquet) or a recording's
spool, so `analyze` works on an unfinished recording too; ``Trace`` reads it a kind at a
time, under the storage column names (``frame``) or the kind's meaningful ones
(``view``, trainbpf.trace.schema.KIND_NAMES).  Writing is trainbpf.trace.spool's job; its names are
re-exported here for the recorder's and the tests' imports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainbpf.trace.errors import TraceReadError
from trainbpf.trace.meta import decode_meta, derive_final_meta
from trainbpf.trace.safefile import fd_path, open_input
from trainbpf.trace.schema import (
    COLUMNS,
    KIND_COLUMNS,
    TRACE_SCHEMA,
    V2_COLUMNS,
    named_frame,
    storage_column,
)
from trainbpf.trace.spool import read_spool, settle, spool_path_for



class Trace:
    """A loaded trace: its metadata and its rows, read a kind at a time.

    A Parquet trace is read lazily, each kind's columns from the row groups that can hold
    it (row-group statistics of `kind`); the long table is only materialised when `table`
    is asked for.  A spool, or a table given directly, is held in memory."""

    def __init__(self, path: Path, meta: dict[str, Any], table: pa.Table | None = None, *,
                 parquet: pq.ParquetFile | None = None):
        if table is None and parquet is None:
            raise ValueError("a Trace needs a table or a Parquet file")
        self.path = Path(path)
        self.meta = meta
        self._table = table
        self._parquet = parquet
        self._frames: dict[str, pd.DataFrame] = {}
        self._kind_chunks: list[pa.DictionaryArray] | None = None
        self._row_groups: tuple[dict[str, list[int]], list[int]] | None = None

    def __repr__(self) -> str:
        return f"Trace(path={str(self.path)!r}, rows={self.num_rows})"

    @property
    def table(self) -> pa.Table:
        """The whole long table (every kind, every column)."""
        if self._table is None:
            table = self._read_columns(lambda pf, cols: pf.read(columns=cols), list(COLUMNS))
            self._table = self._read(lambda _: table.cast(TRACE_SCHEMA))  # out of range: TraceReadError
        return self._table

    @property
    def num_rows(self) -> int:
        return self._parquet.metadata.num_rows if self._table is None else self._table.num_rows

    def chunks(self, columns: Iterable[str]) -> Iterator[pa.Table]:
        """`columns` of every row, every kind, a row group at a time."""
        names = list(columns)
        if self._table is not None:
            yield self._table.select(names)
            return
        for i in range(self._parquet.metadata.num_row_groups):
            yield self._read_columns(lambda pf, cols: pf.read_row_group(i, columns=cols), names)

    def frame(self, kind: str, columns: Iterable[str] | None = None) -> pd.DataFrame:
        """Rows of one kind with exactly that kind's columns (empty frame if none), or
        only `columns` of them.  Whole frames are kept for the next call; a projection
        is read afresh (the analyzers read large kinds once, then let them go).

        Integer columns without nulls are numpy int64/int32; with nulls, pandas Int64."""
        names = list(KIND_COLUMNS[kind] if columns is None else columns)
        unknown = [c for c in names if c not in KIND_COLUMNS[kind]]
        if unknown:
            raise ValueError(f"{kind} rows have no columns {unknown}")
        if kind in self._frames:
            whole = self._frames[kind]
            return whole if columns is None else whole[names]
        rows = self._rows_of(kind, names)
        _check_rows(kind, rows, self.path)
        out = _frame_of(rows, names)
        if columns is None:
            self._frames[kind] = out
        release_unused_memory()  # the reader's scratch
        return out

    def view(self, kind: str, columns: Iterable[str] | None = None) -> pd.DataFrame:
        """`frame(kind, ...)` under the kind's meaningful column names (schema.KIND_NAMES:
        a gpu row's `index` and `util_pct`, a dirty pause's `limit_pages`); `columns`
        are meaningful names too."""
        stored = None if columns is None else [storage_column(kind, c) for c in columns]
        return named_frame(kind, self.frame(kind, stored))

    @property
    def duration_ns(self) -> int:
        clock = self.meta.get("clock") or {}
        return max(0, int(clock.get("end_mono_ns") or 0) - int(clock.get("start_mono_ns") or 0))

    def _rows_of(self, kind: str, names: list[str]) -> pa.Table:
        by_kind, mixed = self._kind_row_groups() if self._table is None else ({}, [])
        if self._table is None and not mixed:
            groups = by_kind.get(kind, [])
            schema = pa.schema([TRACE_SCHEMA.field(n) for n in names])
            if not groups:
                return schema.empty_table()
            rows = self._read_columns(lambda pf, cols: pf.read_row_groups(groups, columns=cols), names)
            return rows if rows.schema.equals(schema) else self._read(lambda _: rows.cast(schema))
        # A spool, a table given, or a file written before row groups held one kind each.
        if self._kind_chunks is None:
            # Encode the kind column once: one pass over its strings, not one per kind.
            self._kind_chunks = [pc.dictionary_encode(c) for c in self.table["kind"].chunks]
        return self.table.select(names).filter(
            pa.chunked_array([pc.equal(c.indices, c.dictionary.index(kind)) for c in self._kind_chunks], type=pa.bool_())
        )

    def _kind_row_groups(self) -> tuple[dict[str, list[int]], list[int]]:
        """Row groups of one kind, by kind (from the statistics of `kind`), and the rest."""
        if self._row_groups is None:
            meta = self._parquet.metadata
            at = meta.schema.to_arrow_schema().get_field_index("kind")
            by_kind: dict[str, list[int]] = {}
            mixed: list[int] = []
            for i in range(meta.num_row_groups):
                stats = meta.row_group(i).column(at).statistics
                if stats is not None and stats.has_min_max and stats.min == stats.max and not stats.null_count:
                    by_kind.setdefault(stats.min, []).append(i)
                else:
                    mixed.append(i)
            self._row_groups = by_kind, mixed
        return self._row_groups

    def _read_columns(self, read, names: list[str]) -> pa.Table:
        """`read(parquet, columns)` of `names`; a column the file lacks (an older
        schema version's file: V2_COLUMNS) comes back all null, in its place."""
        present = set(self._parquet.schema_arrow.names)
        table = self._read(lambda pf: read(pf, [n for n in names if n in present]))
        if all(n in present for n in names):
            return table
        cols = [table[n] if n in present else pa.nulls(table.num_rows, TRACE_SCHEMA.field(n).type) for n in names]
        return pa.Table.from_arrays(cols, schema=pa.schema([TRACE_SCHEMA.field(n) for n in names]))

    def _read(self, read):
        try:
            return read(self._parquet)
        except (pa.ArrowException, OSError) as exc:  # a value its column's type cannot hold, too
            raise TraceReadError(f"{self.path}: truncated or corrupt Parquet file ({exc})") from exc


# Columns a recorder always fills in a row of a kind that has them, and those that are
# never negative (thread ids, nanoseconds).
REQUIRED_COLUMNS = ("ts_ns", "tid")
NON_NEGATIVE_COLUMNS = ("ts_ns", "tid", "pid", "dur_ns", "runq_ns")
# Nanoseconds of CLOCK_MONOTONIC stay below 2**62 (146 years of uptime); a larger one is
# damage, and sums of such times would overflow int64 in the analysis.
NS_COLUMNS = ("ts_ns", "dur_ns", "runq_ns")
MAX_NS = 2**62


def _check_rows(kind: str, rows: pa.Table, path: Path) -> None:
    """A row no recorder writes (a null thread id, a negative duration) is a damaged
    trace: a one-line TraceReadError, not a wrong answer or a crash further on."""
    for name in rows.column_names:
        col = rows[name]
        if name in REQUIRED_COLUMNS and col.null_count:
            raise TraceReadError(f"{path}: corrupt trace: {col.null_count} {kind} rows have no {name}")
        if name not in NON_NEGATIVE_COLUMNS or len(col) == col.null_count:
            continue
        bounds = pc.min_max(col)  # one pass over the column for both checks
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low is not None and low < 0:
            bad = pc.sum(pc.less(col, 0)).as_py()
            raise TraceReadError(f"{path}: corrupt trace: {bad} {kind} rows have a negative {name} ({low})")
        if name in NS_COLUMNS and high is not None and high >= MAX_NS:
            bad = pc.sum(pc.greater_equal(col, MAX_NS)).as_py()
            raise TraceReadError(f"{path}: corrupt trace: {bad} {kind} rows have a {name} beyond any clock "
                                 f"reading ({high})")


def release_unused_memory() -> None:
    """Hand memory Arrow freed back to the system: its allocator keeps freed memory for
    reuse, which after reading tens of millions of rows is hundreds of MB."""
    pa.default_memory_pool().release_unused()


def _frame_of(sub: pa.Table, names: list[str]) -> pd.DataFrame:
    out = {}
    for name in names:
        col = sub[name]
        typ = TRACE_SCHEMA.field(name).type
        # Converted column-wise by Arrow, never through Python objects (traces run to
        # tens of millions of rows).
        if pa.types.is_integer(typ):
            if col.null_count:
                out[name] = col.cast(pa.int64()).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get).array
            else:
                out[name] = col.to_numpy().astype(typ.to_pandas_dtype(), copy=False)
        elif pa.types.is_floating(typ):
            out[name] = col.to_numpy(zero_copy_only=False).astype("float64")
        elif col.null_count < len(col):
            out[name] = col.to_pandas().array
        else:  # empty or all null: object, as pandas infers for a list of Nones
            out[name] = np.full(len(col), None, dtype=object)
    return pd.DataFrame(out, columns=names, copy=False)


def _type_family(typ: pa.DataType) -> str:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    for family, test in (("integer", pa.types.is_integer), ("float", pa.types.is_floating),
                         ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t))):
        if test(typ):
            return family
    return str(typ)


def _check_column_types(schema: pa.Schema, path: Path) -> None:
    """Each column holds what TRACE_SCHEMA says (integers of another width pass: they
    are cast as they are read, and a value out of range is a TraceReadError then)."""
    for field in TRACE_SCHEMA:
        if field.name not in schema.names:  # a V2 column of an older file (checked above)
            continue
        found = schema.field(field.name).type
        if not pa.types.is_null(found) and _type_family(found) != _type_family(field.type):
            raise TraceReadError(f"{path}: not a trainbpf trace (column {field.name} holds {found}, "
                                 f"expected {field.type})")


def read_trace(path: str | os.PathLike) -> Trace:
    """Open a finished trace or, if given (or if only it exists), a recording's spool.
    A Parquet trace's rows are read as they are asked for (Trace.frame).  Only a regular
    file is read: a FIFO or a device is refused, never waited on."""
    path = Path(path)
    if not os.path.lexists(path) and os.path.lexists(spool_path_for(path)):
        path = spool_path_for(path)
    fd = open_input(path)
    try:
        magic = os.pread(fd, 4, 0)
        if magic == b"PAR1":
            try:
                # its own descriptor of this very file, whatever the name (and its bytes)
                pf = pq.ParquetFile(pa.OSFile(fd_path(fd), "rb"), pre_buffer=True)  # coalesced reads
                meta = decode_meta(pf.schema_arrow.metadata, path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise TraceReadError(f"{path}: truncated or corrupt Parquet file ({exc})") from exc
            missing = [c for c in COLUMNS if c not in pf.schema_arrow.names and c not in V2_COLUMNS]
            if missing:
                raise TraceReadError(f"{path}: not a trainbpf trace (missing columns {missing})")
            _check_column_types(pf.schema_arrow, path)
            return Trace(path, meta, parquet=pf)
        if magic == b"\xff\xff\xff\xff":  # Arrow IPC stream continuation marker
            table, meta = read_spool(fd, path)
            meta = derive_final_meta(table, meta)
            table = pa.Table.from_batches(list(settle(table.to_batches(), meta)), schema=TRACE_SCHEMA)
            meta.setdefault("complete", False)
            return Trace(path, meta, table)
    finally:
        os.close(fd)
    if not magic:
        raise TraceReadError(f"{path}: empty file, not a trace")
    raise TraceReadError(f"{path}: not a Parquet trace file")
