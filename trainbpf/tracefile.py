"""Writing and reading trace files.

While recording, rows go to an Arrow IPC stream (``<output>.spool``) in complete record
batches, flushed about once a second: a recorder killed with SIGKILL or stopped by a full
disk leaves every batch before the last flush readable.  ``finalize`` turns the spool into
the Parquet file (footer and final metadata written once, then an atomic rename) and
removes the spool.  ``read_trace`` reads either form, so `analyze` works on an unfinished
recording too; ``recover`` finalises a spool left behind.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from trainbpf.errors import OutputError, TraceReadError, TraceSchemaError
from trainbpf.safefile import (
    create_exclusive,
    fd_path,
    invoker,
    lock_holder,
    open_input,
    output_error,
    same_file,
    try_lock,
    write_new,
)
from trainbpf.schema import (
    COLUMNS,
    KIND_COLUMNS,
    KINDS,
    METADATA_KEY,
    SCHEMA_ID,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    TRACE_SCHEMA,
)

SPOOL_SUFFIX = ".spool"
ROW_GROUP_ROWS = 1 << 20  # pyarrow's default for a whole-table write
# Dictionaries for the few-valued columns (ids, names, states), deltas for nanoseconds and
# counts (timestamps arrive nearly sorted), zstd over all: smaller than the defaults and
# faster to read.
DICTIONARY_COLUMNS = ("kind", "tid", "pid", "cpu", "comm", "state", "peer_tid", "peer_pid", "kstack_id", "ustack_id",
                      "peer_kstack_id", "peer_ustack_id", "addr", "op", "name", "node")
DELTA_COLUMNS = ("ts_ns", "dur_ns", "runq_ns", "size", "count")
# Rows finalize holds back, all kinds together, before it writes the largest kind's
# rows as a shorter row group: its memory stays bounded whatever the mix of kinds.
PENDING_ROWS = 2 * ROW_GROUP_ROWS


def spool_path_for(output: Path) -> Path:
    return output.with_name(output.name + SPOOL_SUFFIX)


def make_batch(kind: str, columns: Mapping[str, Any]) -> pa.RecordBatch:
    """One record batch of `kind` rows; columns not given are null.

    `columns` maps column names to equal-length sequences (numpy arrays, lists)."""
    allowed = KIND_COLUMNS[kind]
    lengths = {len(v) for v in columns.values()}
    if len(lengths) != 1:
        raise ValueError(f"{kind}: columns of unequal length {lengths}")
    n = lengths.pop()
    arrays = []
    for name in COLUMNS:
        typ = TRACE_SCHEMA.field(name).type
        if name == "kind":
            arrays.append(pa.array([kind] * n, type=typ))
        elif name in columns:
            if name not in allowed:
                raise ValueError(f"{kind} rows do not use column {name}")
            arrays.append(pa.array(columns[name], type=typ, from_pandas=True))
        else:
            arrays.append(pa.nulls(n, type=typ))
    return pa.RecordBatch.from_arrays(arrays, schema=TRACE_SCHEMA)


def check_spool_free(spool: Path) -> None:
    """Refuse to start a recording whose spool exists: another recorder is writing it
    (named by its pid), or it is an unfinished recording that `recover` would save."""
    try:
        fd = os.open(spool, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        why = "is a symbolic link, not a regular file" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise OutputError(f"spool {spool} exists and {why}; remove it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputError(f"spool {spool} exists and is not a regular file; remove it")
        if not try_lock(fd):
            holder = lock_holder(fd)
            raise OutputError(f"another recorder (pid {holder or '?'}) is writing {spool}; "
                              "give this recording another -o")
        raise OutputError(f"{spool} holds an unfinished recording: save it with `trainbpf recover {spool}` "
                          "(or remove it), then record again")
    finally:
        os.close(fd)


def _meta_bytes(meta: Mapping[str, Any]) -> dict[bytes, bytes]:
    return {METADATA_KEY: json.dumps(meta, sort_keys=True, default=_json_default).encode()}


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


class SpoolWriter:
    """Appends record batches to the crash-safe spool of `output`."""

    def __init__(self, output: Path, meta: Mapping[str, Any]):
        self.output = Path(output)
        self.spool = spool_path_for(self.output)
        self.bytes_written = 0
        self.rows_written = 0
        self._pending: list[pa.RecordBatch] = []
        self.failed: OutputError | None = None
        try:
            # Created, never reopened by name: finalize reads this descriptor, and its
            # lock tells a second recorder (or `recover`) that it is being written.
            self.fd = create_exclusive(self.spool, owner=invoker(), flags=os.O_RDWR)
        except FileExistsError:
            check_spool_free(self.spool)
            raise OutputError(f"spool {self.spool} appeared while starting; give another -o") from None
        except OSError as exc:
            raise output_error(self.spool, exc) from exc
        try:
            try_lock(self.fd)  # a file just created: nobody else holds it
            self._file = os.fdopen(os.dup(self.fd), "wb")
            schema = TRACE_SCHEMA.with_metadata(_meta_bytes(meta))
            self._writer = ipc.new_stream(self._file, schema)
            self._file.flush()
        except OSError as exc:
            os.close(self.fd)
            raise output_error(self.spool, exc) from exc

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._pending.append(batch)

    def flush(self) -> None:
        """Write pending rows as one complete batch and push it to the file."""
        if not self._pending or self.failed:
            return
        table = pa.Table.from_batches(self._pending, schema=TRACE_SCHEMA)
        self._pending = []
        try:
            for batch in table.combine_chunks().to_batches():
                self._writer.write_batch(batch)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            # Keep what is already on disk readable; the recorder stops and reports.
            self.failed = output_error(self.spool, exc)
            return
        self.rows_written += table.num_rows
        self.bytes_written = self._file.tell()

    def close(self, *, keep_open: bool = False) -> None:
        """End the stream.  With `keep_open` the spool stays open (and locked) for
        finalize(spool_fd=writer.fd); release() lets it go."""
        try:
            if not self.failed:
                self._writer.close()
            self._file.close()
        except OSError as exc:
            self.failed = self.failed or output_error(self.spool, exc)
        if not keep_open:
            self.release()

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _spool_batches(fd: int, path: Path) -> tuple[Iterator[pa.RecordBatch], dict[str, Any]]:
    """A spool's metadata, and its complete batches one at a time, tolerating a torn tail.
    Read from the open descriptor `fd`, never by name (`path` is for messages)."""
    try:
        reader = ipc.open_stream(pa.OSFile(fd_path(fd), "rb"))
    except (pa.ArrowInvalid, OSError):
        # Arrow's own message quotes the file's first bytes: not for a root tool's stderr.
        raise TraceReadError(f"{path}: not a readable trainbpf spool") from None
    meta = _decode_meta(reader.schema.metadata, path)

    def batches() -> Iterator[pa.RecordBatch]:
        while True:
            try:
                yield reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError):
                return  # torn last batch after a crash: keep what came before

    return batches(), meta


def _read_spool(fd: int, path: Path) -> tuple[pa.Table, dict[str, Any]]:
    """Every complete batch of a spool."""
    batches, meta = _spool_batches(fd, path)
    return pa.Table.from_batches(list(batches), schema=TRACE_SCHEMA), meta


# Metadata sections that are JSON objects, and those whose values are all integers
# (counters): checked when a trace is read, so a damaged trace is a one-line error, not
# a crash deep inside the analysis.
META_OBJECTS = ("clock", "topology", "thresholds", "gpu", "lost", "stacks")
META_COUNTERS = ("lost", "stacks")
# The single values the analysis computes with: clock instants (nanoseconds, int64) and
# thread ids (kernel pids, int32); each may be absent or null.
META_INSTANTS = ("start_mono_ns", "end_mono_ns", "wall_minus_mono_ns")
META_IDS = ("target_pid", "trainer_tid")
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


def _decode_meta(raw: Mapping[bytes, bytes] | None, path: Path) -> dict[str, Any]:
    if not raw or METADATA_KEY not in raw:
        raise TraceReadError(f"{path}: not a trainbpf trace (no trainbpf metadata)")
    try:
        meta = json.loads(raw[METADATA_KEY])
    except ValueError as exc:
        raise TraceReadError(f"{path}: corrupt trainbpf metadata") from exc
    if not isinstance(meta, dict):
        _check_meta_shape(meta, path)
    schema = str(meta.get("schema", ""))
    name, _, version = schema.partition("/")
    if name != SCHEMA_NAME:
        raise TraceSchemaError(f"{path}: unknown trace schema {schema!r}, expected {SCHEMA_ID}")
    if not version.isdigit() or int(version) != SCHEMA_VERSION:
        newer = version.isdigit() and int(version) > SCHEMA_VERSION
        hint = "upgrade trainbpf to read it" if newer else "re-record it with this version"
        raise TraceSchemaError(f"{path}: trace schema {schema} is not {SCHEMA_ID}; {hint}")
    _check_meta_shape(meta, path)
    return meta


def _derive_final_meta(rows: pa.Table | Iterable[pa.RecordBatch], meta: dict[str, Any]) -> dict[str, Any]:
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


def _settle(batches: Iterable[pa.RecordBatch], meta: Mapping[str, Any]) -> Iterator[pa.RecordBatch]:
    """The spool's rows as the trace holds them: segment marks dropped, and the intervals
    still open at a flush dropped too, except, for a recording that did not finish, those
    cut at its end (its last segment), which become off-CPU intervals ending there."""
    keep_end = None if meta.get("complete") else (meta.get("clock") or {}).get("end_mono_ns")
    for batch in batches:
        kind = batch.column("kind")
        is_open = pc.fill_null(pc.equal(kind, "offcpu_open"), False)
        drop = pc.or_(pc.fill_null(pc.equal(kind, "segment"), False), is_open)
        if not pc.any(drop).as_py():
            yield batch
            continue
        if keep_end is not None:
            ends = pc.add(batch.column("ts_ns"), pc.fill_null(batch.column("dur_ns"), 0))
            last = pc.and_(is_open, pc.fill_null(pc.equal(ends, keep_end), False))
            drop = pc.and_(drop, pc.invert(last))
            kind = pc.if_else(last, pa.scalar("offcpu"), kind)
            batch = pa.RecordBatch.from_arrays([kind if n == "kind" else batch.column(n) for n in batch.schema.names],
                                               schema=batch.schema)
        yield batch.filter(pc.invert(drop))


def finalize(spool: Path, output: Path, final_meta: Mapping[str, Any] | None = None, *,
             spool_fd: int | None = None, force: bool = False) -> Path:
    """Write the Parquet file from a spool (atomically) and remove the spool.

    `spool_fd` is the recorder's own descriptor of the spool: the file finalised is the
    one it wrote, whatever has happened to the name since.  Without it the spool is
    opened here and locked, so a recorder still writing it is refused.  An existing
    `output` is replaced only with `force` (safefile.check_output).

    Two passes over the spool, a batch at a time, so memory stays bounded however long
    the recording: the first finds what the metadata needs from the rows (which the
    Parquet file states before its first row), the second writes.  Each row group holds
    one kind (each kind's rows in recording order), so a reader picks a kind's row groups
    by the statistics of `kind` and skips the rest; the long table is the same rows."""
    spool, output = Path(spool), Path(output)
    fd = open_spool(spool) if spool_fd is None else spool_fd
    try:
        batches, meta = _spool_batches(fd, spool)
        meta.update(final_meta or {})
        meta = _derive_final_meta(batches, meta)

        def write(fh) -> None:
            with pq.ParquetWriter(fh, TRACE_SCHEMA.with_metadata(_meta_bytes(meta)), compression="zstd",
                                  use_dictionary=list(DICTIONARY_COLUMNS),
                                  column_encoding=dict.fromkeys(DELTA_COLUMNS, "DELTA_BINARY_PACKED")) as writer:
                groups = _KindRowGroups(writer)
                for batch in _settle(_spool_batches(fd, spool)[0], meta):
                    groups.add(batch)
                groups.close()

        write_new(output, write, owner=invoker(), force=force)
        if same_file(fd, spool):  # not a file swapped in under the spool's name
            spool.unlink()
    finally:
        if spool_fd is None:
            os.close(fd)
    return output


def open_spool(spool: Path) -> int:
    """Open a left-over spool for finalising: a regular file no recorder is writing."""
    fd = open_input(spool)
    if not try_lock(fd):
        holder = lock_holder(fd)
        os.close(fd)
        raise TraceReadError(f"{spool}: a recorder (pid {holder or '?'}) is still writing it; "
                             "analyze reads it as it is, recover it once the recorder has stopped")
    return fd


def discard_stale_spool(spool: Path) -> bool:
    """Remove the spool of a recording that was killed (nobody holds its lock): for
    callers whose recordings are scratch (health).  True if one was removed."""
    try:
        fd = open_spool(spool)
    except TraceReadError:
        if not os.path.lexists(spool):
            return False
        raise
    try:
        if same_file(fd, spool):
            spool.unlink()
            return True
        return False
    finally:
        os.close(fd)


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


def recover(spool: Path, output: Path | None = None, *, force: bool = False) -> Path:
    """Finalise a spool left by a recorder that did not finish (killed, disk full)."""
    spool = Path(spool)
    if output is None:
        name = spool.name[: -len(SPOOL_SUFFIX)] if spool.name.endswith(SPOOL_SUFFIX) else spool.name + ".parquet"
        output = spool.with_name(name)
    return finalize(spool, Path(output), {"recovered": True, "complete": False}, force=force)


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
            self._table = self._read(lambda pf: pf.read(columns=list(COLUMNS)).cast(TRACE_SCHEMA))
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
            yield self._read(lambda pf: pf.read_row_group(i, columns=names))

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
            rows = self._read(lambda pf: pf.read_row_groups(groups, columns=names))
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

    def _read(self, read):
        try:
            return read(self._parquet)
        except (pa.ArrowException, OSError) as exc:  # a value its column's type cannot hold, too
            raise TraceReadError(f"{self.path}: truncated or corrupt Parquet file ({exc})") from exc


# Columns a recorder always fills in a row of a kind that has them, and those that are
# never negative (thread ids, nanoseconds).
REQUIRED_COLUMNS = ("ts_ns", "tid")
NON_NEGATIVE_COLUMNS = ("ts_ns", "tid", "pid", "dur_ns", "runq_ns")


def _check_rows(kind: str, rows: pa.Table, path: Path) -> None:
    """A row no recorder writes (a null thread id, a negative duration) is a damaged
    trace: a one-line TraceReadError, not a wrong answer or a crash further on."""
    for name in rows.column_names:
        col = rows[name]
        if name in REQUIRED_COLUMNS and col.null_count:
            raise TraceReadError(f"{path}: corrupt trace: {col.null_count} {kind} rows have no {name}")
        if name in NON_NEGATIVE_COLUMNS and len(col) > col.null_count:
            low = pc.min(col).as_py()
            if low is not None and low < 0:
                bad = pc.sum(pc.less(col, 0)).as_py()
                raise TraceReadError(f"{path}: corrupt trace: {bad} {kind} rows have a negative {name} ({low})")


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
                meta = _decode_meta(pf.schema_arrow.metadata, path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise TraceReadError(f"{path}: truncated or corrupt Parquet file ({exc})") from exc
            missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
            if missing:
                raise TraceReadError(f"{path}: not a trainbpf trace (missing columns {missing})")
            _check_column_types(pf.schema_arrow, path)
            return Trace(path, meta, parquet=pf)
        if magic == b"\xff\xff\xff\xff":  # Arrow IPC stream continuation marker
            table, meta = _read_spool(fd, path)
            meta = _derive_final_meta(table, meta)
            table = pa.Table.from_batches(list(_settle(table.to_batches(), meta)), schema=TRACE_SCHEMA)
            meta.setdefault("complete", False)
            return Trace(path, meta, table)
    finally:
        os.close(fd)
    if not magic:
        raise TraceReadError(f"{path}: empty file, not a trace")
    raise TraceReadError(f"{path}: not a Parquet trace file")
