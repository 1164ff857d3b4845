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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from trainbpf.errors import OutputError, TraceReadError, TraceSchemaError
from trainbpf.schema import (
    COLUMNS,
    KIND_COLUMNS,
    METADATA_KEY,
    SCHEMA_ID,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    TRACE_SCHEMA,
)

SPOOL_SUFFIX = ".spool"
ROW_GROUP_ROWS = 1 << 20  # pyarrow's default for a whole-table write


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


def _open_private(path: Path):
    """Create `path` 0600 (traces hold command names, paths and addresses)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


def _chown_to_invoker(path: Path) -> None:
    """Under sudo, hand the file to the user who ran sudo."""
    uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
    if os.geteuid() == 0 and uid and gid:
        try:
            os.chown(path, int(uid), int(gid))
        except (OSError, ValueError):
            pass


def _output_error(path: Path, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {path}")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


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
            self._file = _open_private(self.spool)
            _chown_to_invoker(self.spool)
            schema = TRACE_SCHEMA.with_metadata(_meta_bytes(meta))
            self._writer = ipc.new_stream(self._file, schema)
            self._file.flush()
        except OSError as exc:
            raise _output_error(self.spool, exc) from exc

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
            self.failed = _output_error(self.spool, exc)
            return
        self.rows_written += table.num_rows
        self.bytes_written = self._file.tell()

    def close(self) -> None:
        try:
            if not self.failed:
                self._writer.close()
            self._file.close()
        except OSError as exc:
            self.failed = self.failed or _output_error(self.spool, exc)


def _spool_batches(path: Path) -> tuple[Iterator[pa.RecordBatch], dict[str, Any]]:
    """A spool's metadata, and its complete batches one at a time, tolerating a torn tail."""
    try:
        reader = ipc.open_stream(pa.OSFile(str(path), "rb"))
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceReadError(f"{path}: not a readable trainbpf spool ({exc})") from exc
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


def _read_spool(path: Path) -> tuple[pa.Table, dict[str, Any]]:
    """Every complete batch of a spool."""
    batches, meta = _spool_batches(path)
    return pa.Table.from_batches(list(batches), schema=TRACE_SCHEMA), meta


def _decode_meta(raw: Mapping[bytes, bytes] | None, path: Path) -> dict[str, Any]:
    if not raw or METADATA_KEY not in raw:
        raise TraceReadError(f"{path}: not a trainbpf trace (no trainbpf metadata)")
    try:
        meta = json.loads(raw[METADATA_KEY])
    except ValueError as exc:
        raise TraceReadError(f"{path}: corrupt trainbpf metadata") from exc
    schema = str(meta.get("schema", ""))
    name, _, version = schema.partition("/")
    if name != SCHEMA_NAME:
        raise TraceSchemaError(f"{path}: unknown trace schema {schema!r}, expected {SCHEMA_ID}")
    if not version.isdigit() or int(version) != SCHEMA_VERSION:
        newer = version.isdigit() and int(version) > SCHEMA_VERSION
        hint = "upgrade trainbpf to read it" if newer else "re-record it with this version"
        raise TraceSchemaError(f"{path}: trace schema {schema} is not {SCHEMA_ID}; {hint}")
    return meta


def _derive_final_meta(rows: pa.Table | Iterable[pa.RecordBatch], meta: dict[str, Any]) -> dict[str, Any]:
    """Fill what only the end of a recording knows from the rows, for recovered spools.
    `rows`: a table, or batches read one at a time."""
    meta = dict(meta)
    counts: dict[str, int] = dict(meta.get("lost") or {})
    lost: dict[str, int] = {}  # newest (largest) cumulative count per probe
    end: int | None = None
    any_rows = False
    for batch in rows.to_batches() if isinstance(rows, pa.Table) else rows:
        if not batch.num_rows:
            continue
        any_rows = True
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
        clock["end_mono_ns"] = int(end or clock.get("start_mono_ns", 0))
    meta["clock"] = clock
    return meta


def finalize(spool: Path, output: Path, final_meta: Mapping[str, Any] | None = None) -> Path:
    """Write the Parquet file from a spool (atomically) and remove the spool.

    Two passes over the spool, a row group at a time, so memory stays bounded however
    long the recording: the first finds what the metadata needs from the rows (which the
    Parquet file states before its first row), the second writes."""
    batches, meta = _spool_batches(spool)
    meta.update(final_meta or {})
    meta = _derive_final_meta(batches, meta)
    tmp = output.with_name(output.name + ".tmp")
    try:
        with _open_private(tmp) as fh, \
                pq.ParquetWriter(fh, TRACE_SCHEMA.with_metadata(_meta_bytes(meta)), compression="zstd") as writer:
            pending: list[pa.RecordBatch] = []
            rows = 0
            for batch in _spool_batches(spool)[0]:
                pending.append(batch)
                rows += batch.num_rows
                while rows >= ROW_GROUP_ROWS:  # full row groups, as a whole-table write makes them
                    table = pa.Table.from_batches(pending, schema=TRACE_SCHEMA)
                    writer.write_table(table.slice(0, ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
                    rest = table.slice(ROW_GROUP_ROWS)
                    pending, rows = rest.to_batches(), rest.num_rows
            if rows:
                writer.write_table(pa.Table.from_batches(pending, schema=TRACE_SCHEMA), row_group_size=ROW_GROUP_ROWS)
        _chown_to_invoker(tmp)
        os.replace(tmp, output)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _output_error(output, exc) from exc
    spool.unlink(missing_ok=True)
    return output


def recover(spool: Path, output: Path | None = None) -> Path:
    """Finalise a spool left by a recorder that did not finish (killed, disk full)."""
    spool = Path(spool)
    if not spool.exists():
        raise TraceReadError(f"{spool}: no such file")
    if output is None:
        name = spool.name[: -len(SPOOL_SUFFIX)] if spool.name.endswith(SPOOL_SUFFIX) else spool.name + ".parquet"
        output = spool.with_name(name)
    return finalize(spool, Path(output), {"recovered": True, "complete": False})


@dataclass
class Trace:
    """A loaded trace: its metadata and the long table of rows."""

    path: Path
    meta: dict[str, Any]
    table: pa.Table
    _frames: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)
    _kind_chunks: list[pa.DictionaryArray] | None = field(default=None, repr=False)

    def frame(self, kind: str) -> pd.DataFrame:
        """Rows of one kind with exactly that kind's columns (empty frame if none).

        Integer columns without nulls are numpy int64/int32; with nulls, pandas Int64."""
        if kind not in self._frames:
            if self._kind_chunks is None:
                # Encode the kind column once: one pass over its strings, not one per kind.
                self._kind_chunks = [pc.dictionary_encode(c) for c in self.table["kind"].chunks]
            mask = pa.chunked_array(
                [pc.equal(c.indices, c.dictionary.index(kind)) for c in self._kind_chunks], type=pa.bool_()
            )
            self._frames[kind] = _kind_frame(self.table, kind, mask)
        return self._frames[kind]

    @property
    def duration_ns(self) -> int:
        clock = self.meta.get("clock", {})
        return max(0, int(clock.get("end_mono_ns") or 0) - int(clock.get("start_mono_ns") or 0))


def _kind_frame(table: pa.Table, kind: str, mask: pa.ChunkedArray | None = None) -> pd.DataFrame:
    cols = list(KIND_COLUMNS[kind])
    if mask is None:
        mask = pc.equal(table["kind"], kind)
    sub = table.select(cols).filter(mask)
    out = {}
    for name in cols:
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
    return pd.DataFrame(out, columns=cols)


def read_trace(path: str | os.PathLike) -> Trace:
    """Load a finished trace or, if given (or if only it exists), a recording's spool."""
    path = Path(path)
    if not path.exists():
        spool = spool_path_for(path)
        if spool.exists():
            path = spool
        else:
            raise TraceReadError(f"{path}: no such file")
    if path.is_dir():
        raise TraceReadError(f"{path}: is a directory, not a trace file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"PAR1":
        try:
            pf = pq.ParquetFile(path)
            meta = _decode_meta(pf.schema_arrow.metadata, path)
            table = pf.read()
        except (pa.ArrowInvalid, OSError) as exc:
            raise TraceReadError(f"{path}: truncated or corrupt Parquet file ({exc})") from exc
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise TraceReadError(f"{path}: not a trainbpf trace (missing columns {missing})")
        table = table.select(list(COLUMNS)).cast(TRACE_SCHEMA)
    elif magic == b"\xff\xff\xff\xff":  # Arrow IPC stream continuation marker
        table, meta = _read_spool(path)
        meta = _derive_final_meta(table, meta)
        meta.setdefault("complete", False)
    elif not magic:
        raise TraceReadError(f"{path}: empty file, not a trace")
    else:
        raise TraceReadError(f"{path}: not a Parquet trace file")
    return Trace(path=path, meta=meta, table=table)
