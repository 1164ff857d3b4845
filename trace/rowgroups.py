"""The Parquet layout of a finished trace: one kind's rows per row group (each kind's rows
in recording order), so a reader picks a kind's row groups by the statistics of `kind`
and skips the rest; the long table is the same rows.  Memory stays bounded: at most
PENDING_ROWS rows are held back, whatever the length of the recording."""

from __future__ import annotations

from typing import IO, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainbpf.trace.schema import COLUMNS, KIND_COLUMNS, KINDS, TRACE_SCHEMA

ROW_GROUP_ROWS = 1 << 20  # pyarrow's default for a whole-table write
# Dictionaries for the few-valued columns (ids, names, states), deltas for nanoseconds and
# counts (timestamps arrive nearly sorted), zstd over all: smaller than the defaults and
# faster to read.
DICTIONARY_COLUMNS = ("kind", "tid", "pid", "cpu", "comm", "state", "peer_tid", "peer_pid", "kstack_id", "ustack_id",
                      "peer_kstack_id", "peer_ustack_id", "addr", "op", "name", "node", "pystack_id", "peer_pystack_id")
DELTA_COLUMNS = ("ts_ns", "dur_ns", "runq_ns", "size", "count")
# Rows finalize holds back, all kinds together, before it writes the largest kind's
# rows as a shorter row group: its memory stays bounded whatever the mix of kinds.
PENDING_ROWS = 2 * ROW_GROUP_ROWS


def write_parquet(fh: IO[bytes], batches: Iterable[pa.RecordBatch], metadata: dict[bytes, bytes]) -> None:
    """Write `batches` (trace rows) as one Parquet file with the schema's `metadata`."""
    with pq.ParquetWriter(fh, TRACE_SCHEMA.with_metadata(metadata), compression="zstd",
                          use_dictionary=list(DICTIONARY_COLUMNS),
                          column_encoding=dict.fromkeys(DELTA_COLUMNS, "DELTA_BINARY_PACKED")) as writer:
        groups = _KindRowGroups(writer)
        for batch in batches:
            groups.add(batch)
        groups.close()


class _KindRowGroups:
    """Collects rows per kind (only the kind's own columns) and writes each kind as full
    row groups; past PENDING_ROWS held back in all, the largest kind goes out as a
    shorter row group.  Kinds left at the end go out in KINDS order."""

    def __init__(self, writer: pq.ParquetWriter):
        self.writer = writer
        self.pending: dict[str | None, list[pa.Table]] = {}
        self.rows: dict[str | None, int] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        for kind, part in _split_by_kind(batch):
            self.pending.setdefault(kind, []).append(part)
            self.rows[kind] = self.rows.get(kind, 0) + part.num_rows
            while self.rows.get(kind, 0) >= ROW_GROUP_ROWS:
                self._write(kind, ROW_GROUP_ROWS)
        while sum(self.rows.values()) > PENDING_ROWS:
            self._write(max(self.rows, key=self.rows.__getitem__))

    def close(self) -> None:
        order = {kind: i for i, kind in enumerate(KINDS)}
        for kind in sorted(self.pending, key=lambda k: (k is None, order.get(k, len(order)), k or "")):
            self._write(kind)

    def _write(self, kind: str | None, rows: int | None = None) -> None:
        table = pa.concat_tables(self.pending.pop(kind))
        self.rows.pop(kind)
        if rows is not None and rows < table.num_rows:
            rest = table.slice(rows)
            self.pending[kind], self.rows[kind] = [rest], rest.num_rows
            table = table.slice(0, rows)
        columns = [table[name] if name in table.column_names else pa.nulls(table.num_rows, TRACE_SCHEMA.field(name).type)
                   for name in COLUMNS]
        self.writer.write_table(pa.Table.from_arrays(columns, schema=TRACE_SCHEMA), row_group_size=ROW_GROUP_ROWS)


def _split_by_kind(batch: pa.RecordBatch) -> Iterator[tuple[str | None, pa.Table]]:
    """The rows of each kind in `batch` with the kind's columns (all columns for a kind
    the schema does not know, or a null kind)."""
    encoded = pc.dictionary_encode(batch.column("kind"))
    for i, kind in enumerate(encoded.dictionary.to_pylist()):
        names = ["kind", *KIND_COLUMNS[kind]] if kind in KIND_COLUMNS else list(COLUMNS)
        yield kind, pa.Table.from_batches([batch.select(names).filter(pc.equal(encoded.indices, i))])
    if encoded.null_count:
        yield None, pa.Table.from_batches([batch.filter(pc.is_null(encoded.indices))])
