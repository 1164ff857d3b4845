"""Writing trace files.

While recording, rows go to an Arrow IPC stream (``<output>.spool``) in complete record
batches, flushed about once a second: a recorder killed with SIGKILL or stopped by a full
disk leaves every batch before the last flush readable.  ``finalize`` turns the spool into
the Parquet file (footer and final metadata written once, then an atomic rename) and
removes the spool; ``recover`` finalises a spool left behind.  Reading either form is
trainbpf.trace.reader's job.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from trainbpf.trace.errors import OutputError, TraceReadError
from trainbpf.trace.meta import decode_meta, derive_final_meta, meta_bytes
from trainbpf.trace.rowgroups import write_parquet
from trainbpf.trace.safefile import (
    NAME_MAX,
    OutputFile,
    check_output,
    fd_path,
    lock_holder,
    open_input,
    output_error,
    try_lock,
)
from trainbpf.trace.schema import COLUMNS, KIND_COLUMNS, TRACE_SCHEMA, V2_COLUMNS, stored_columns

SPOOL_SUFFIX = ".spool"


def spool_path_for(output: Path) -> Path:
    return output.with_name(output.name + SPOOL_SUFFIX)


def make_batch(kind: str, columns: Mapping[str, Any]) -> pa.RecordBatch:
    """One record batch of `kind` rows; columns not given are null.

    `columns` maps the kind's meaningful column names (schema.view_columns: the names its
    probe's C struct, its collector and the analyzers use) to equal-length sequences
    (numpy arrays, lists); they are stored under the shared storage columns."""
    return stored_batch(kind, stored_columns(kind, columns))


def stored_batch(kind: str, columns: Mapping[str, Any]) -> pa.RecordBatch:
    """make_batch with `columns` under the file's storage names (schema.KIND_COLUMNS):
    for what builds trace files column by column, as the format tests do."""
    allowed = KIND_COLUMNS[kind]
    lengths = {len(v) for v in columns.values()}
    if len(lengths) != 1:
        raise ValueError(f"{kind}: columns of unequal length {lengths}")
    n = lengths.pop()
    unknown = columns.keys() - allowed
    if unknown:
        raise ValueError(f"{kind} rows do not use column {sorted(unknown)[0]}")
    arrays = []
    for name, typ in _COLUMN_TYPES:
        if name == "kind":
            arrays.append(_repeated(kind, n, lambda size: pa.array([kind] * size, type=typ)))
        elif name in columns:
            arrays.append(pa.array(columns[name], type=typ, from_pandas=True))
        else:
            arrays.append(_repeated(typ, n, lambda size: pa.nulls(size, type=typ)))
    return pa.RecordBatch.from_arrays(arrays, schema=TRACE_SCHEMA)


_COLUMN_TYPES = [(name, TRACE_SCHEMA.field(name).type) for name in COLUMNS]
# make_batch runs several times a flush in the recorder; the columns that repeat one value
# (the kind, nulls) are slices of arrays made once, not made anew each time.
_REPEATED: dict[Any, pa.Array] = {}
REPEATED_ROWS = 1 << 14  # longer columns are made as needed: kept, they would hold memory


def _repeated(key: Any, n: int, make: Callable[[int], pa.Array]) -> pa.Array:
    if n > REPEATED_ROWS:
        return make(n)
    array = _REPEATED.get(key)
    if array is None:
        array = _REPEATED[key] = make(REPEATED_ROWS)
    return array.slice(0, n)


def combine(batches: list[pa.RecordBatch]) -> pa.RecordBatch | None:
    """`batches` (of TRACE_SCHEMA) as one batch, None if they hold no rows: what is done
    to a flush's rows runs once, not once for each probe's batch."""
    rows = [b for b in batches if b.num_rows]
    return pa.concat_batches(rows) if rows else None


def check_spool_free(out: OutputFile) -> bool:
    """Refuse to start a recording whose spool exists: another recorder is writing it
    (named by its pid), or it is an unfinished recording that `recover` would save.  An
    empty spool nobody holds (a recorder killed, or a disk full, before the first write)
    is removed: True then."""
    name, spool = out.name + SPOOL_SUFFIX.encode(), spool_path_for(out.path)
    if len(name) > NAME_MAX:
        raise OutputError(f"output {out.path}: the name is too long for its spool ({len(name)} bytes with "
                          f"{SPOOL_SUFFIX}; a file name holds at most {NAME_MAX})")
    try:
        fd = out.files.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dirfd=out.dirfd)
    except FileNotFoundError:
        return False
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
        if is_empty_spool(fd) and out.remove_if_same(fd, name):
            return True
        raise OutputError(f"{spool} holds an unfinished recording: save it with `trainbpf recover {spool}` "
                          "(or remove it), then record again")
    finally:
        os.close(fd)


def is_empty_spool(fd: int) -> bool:
    """Whether the spool open as `fd` ends before its Arrow header does (a recorder that
    stopped before writing anything): nothing in it to recover.  The header starts with
    the stream's continuation marker and the length of the schema message."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return _CONTINUATION.startswith(head[:4])
    return head[:4] == _CONTINUATION and size < 8 + int.from_bytes(head[4:], "little")


_CONTINUATION = b"\xff\xff\xff\xff"


class SpoolWriter:
    """Appends record batches to the crash-safe spool of `output`, in the output's
    folder `out` when given (the recorder's, opened and checked once)."""

    def __init__(self, output: Path, meta: Mapping[str, Any], *, out: OutputFile | None = None):
        self.output = Path(output)
        self.spool = spool_path_for(self.output)
        self.bytes_written = 0
        self.rows_written = 0
        self._pending: list[pa.RecordBatch] = []
        self.failed: OutputError | None = None
        self.fd = -1
        self._out, self._own_out = (out, False) if out is not None else (OutputFile(self.output), True)
        self._name = name = self._out.name + SPOOL_SUFFIX.encode()
        try:
            # Created, never reopened by name: finalize reads this descriptor, and its
            # lock tells a second recorder (or `recover`) that it is being written.
            self.fd = self._out.create(name, flags=os.O_RDWR)
        except FileExistsError:
            try:
                check_spool_free(self._out)
            finally:
                self._close_out()
            raise OutputError(f"spool {self.spool} appeared while starting; give another -o") from None
        except OSError as exc:
            self._close_out()
            raise output_error(self.spool, exc) from exc
        try:
            try_lock(self.fd)  # a file just created: nobody else holds it
            self._file = os.fdopen(os.dup(self.fd), "wb")
            schema = TRACE_SCHEMA.with_metadata(meta_bytes(meta))
            self._writer = ipc.new_stream(self._file, schema)
            self._file.flush()
        except OSError as exc:
            self._out.remove_if_same(self.fd, name)  # no header, nothing to recover
            self.release()
            raise output_error(self.spool, exc) from exc

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._pending.append(batch)

    def flush(self) -> None:
        """Write pending rows as one complete batch and push it to the file."""
        if not self._pending or self.failed:
            return
        batch, self._pending = combine(self._pending), []
        try:
            self._writer.write_batch(batch)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            # Keep what is already on disk readable; the recorder stops and reports.
            self.failed = output_error(self.spool, exc)
            return
        self.rows_written += batch.num_rows
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

    def remove_if_empty(self) -> bool:
        """Remove the spool if it holds no complete header (the disk was full before its
        first write): there is nothing in it to recover.  True if removed."""
        return self.fd >= 0 and is_empty_spool(self.fd) and self._out.remove_if_same(self.fd, self._name)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._close_out()

    def _close_out(self) -> None:
        if self._own_out:
            self._out.close()


def _spool_batches(fd: int, path: Path) -> tuple[Iterator[pa.RecordBatch], dict[str, Any]]:
    """A spool's metadata, and its complete batches one at a time, tolerating a torn tail.
    Read from the open descriptor `fd`, never by name (`path` is for messages)."""
    try:
        reader = ipc.open_stream(pa.OSFile(fd_path(fd), "rb"))
    except (pa.ArrowInvalid, OSError):
        # Arrow's own message quotes the file's first bytes: not for a root tool's stderr.
        raise TraceReadError(f"{path}: not a readable trainbpf spool") from None
    meta = decode_meta(reader.schema.metadata, path)
    # An older version's spool lacks the columns added since (V2_COLUMNS, last in the
    # schema): they are appended, all null.  Any other difference is not a spool this
    # code wrote, and would fail somewhere in the reading.
    missing = [TRACE_SCHEMA.field(n) for n in V2_COLUMNS if n not in reader.schema.names]
    expected = pa.schema([f for f in TRACE_SCHEMA if f not in missing])
    if not reader.schema.remove_metadata().equals(expected):
        raise TraceReadError(f"{path}: not a trainbpf spool ({_schema_difference(reader.schema, expected)})")

    def batches() -> Iterator[pa.RecordBatch]:
        while True:
            try:
                batch = reader.read_next_batch()
                if missing:
                    batch = pa.RecordBatch.from_arrays(
                        list(batch.columns) + [pa.nulls(batch.num_rows, f.type) for f in missing],
                        schema=pa.schema(list(batch.schema) + missing))
                yield batch
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError):
                return  # torn last batch after a crash: keep what came before

    return batches(), meta


def _schema_difference(found: pa.Schema, expected: pa.Schema) -> str:
    """The first way `found` differs from `expected`, in words."""
    for name in expected.names:
        if name not in found.names:
            return f"no column {name}"
    extra = [n for n in found.names if n not in expected.names]
    if extra:
        return f"unknown column {extra[0]}"
    for field in found:
        want = expected.field(field.name).type
        if not field.type.equals(want):
            return f"column {field.name} holds {field.type}, expected {want}"
    return "columns repeated or out of order"


def read_spool(fd: int, path: Path) -> tuple[pa.Table, dict[str, Any]]:
    """Every complete batch of a spool."""
    batches, meta = _spool_batches(fd, path)
    return pa.Table.from_batches(list(batches), schema=TRACE_SCHEMA), meta



def settle(batches: Iterable[pa.RecordBatch], meta: Mapping[str, Any]) -> Iterator[pa.RecordBatch]:
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
             spool_fd: int | None = None, force: bool = False, out: OutputFile | None = None) -> Path:
    """Write the Parquet file from a spool (atomically) and remove the spool; returns
    where the file is.

    `spool_fd` is the recorder's own descriptor of the spool: the file finalised is the
    one it wrote, whatever has happened to the name since.  Without it the spool is
    opened here and locked, so a recorder still writing it is refused.  `out` is the
    output's folder, opened and checked when the recording started; without it `output`
    is checked now.  An existing `output` is replaced only with `force`.

    Two passes over the spool, a batch at a time, so memory stays bounded however long
    the recording: the first finds what the metadata needs from the rows (which the
    Parquet file states before its first row), the second writes.  Each row group holds
    one kind (each kind's rows in recording order), so a reader picks a kind's row groups
    by the statistics of `kind` and skips the rest; the long table is the same rows."""
    spool, output = Path(spool), Path(output)
    fd = open_spool(spool) if spool_fd is None else spool_fd
    target = out
    try:
        target = target or check_output(output, force=force)
        batches, meta = _spool_batches(fd, spool)
        meta.update(final_meta or {})
        meta = derive_final_meta(batches, meta)

        written = target.write(lambda fh: write_parquet(fh, settle(_spool_batches(fd, spool)[0], meta),
                                                         meta_bytes(meta)))
        _remove_spool(fd, spool, target)
    finally:
        if spool_fd is None:
            os.close(fd)
        if out is None and target is not None:
            target.close()
    return written


def _remove_spool(fd: int, spool: Path, out: OutputFile) -> None:
    """Remove the spool's name if it still is the file finalised (not one swapped in
    under it): through the output's folder when it holds the spool."""
    if spool_path_for(out.path) == spool:
        out.remove_if_same(fd, os.fsencode(spool.name))
        return
    with OutputFile(spool) as folder:
        folder.remove_if_same(fd, folder.name)


def _open_unheld(spool: Path) -> int:
    """Open a spool no recorder is writing (its lock taken)."""
    fd = open_input(spool)
    if not try_lock(fd):
        holder = lock_holder(fd)
        os.close(fd)
        raise TraceReadError(f"{spool}: a recorder (pid {holder or '?'}) is still writing it; "
                             "analyze reads it as it is, recover it once the recorder has stopped")
    return fd


def open_spool(spool: Path) -> int:
    """Open a left-over spool for finalising: a regular file no recorder is writing,
    with something in it."""
    fd = _open_unheld(spool)
    if is_empty_spool(fd):
        os.close(fd)
        raise TraceReadError(f"{spool}: empty spool (its recorder stopped before writing anything); "
                             "nothing to recover: remove it")
    return fd


def discard_stale_spool(spool: Path) -> bool:
    """Remove the spool of a recording that was killed (nobody holds its lock): for
    callers whose recordings are scratch (health).  True if one was removed."""
    try:
        fd = _open_unheld(spool)
    except TraceReadError:
        if not os.path.lexists(spool):
            return False
        raise
    try:
        with OutputFile(spool) as folder:
            return folder.remove_if_same(fd, folder.name)
    finally:
        os.close(fd)


def recover(spool: Path, output: Path | None = None, *, force: bool = False) -> Path:
    """Finalise a spool left by a recorder that did not finish (killed, disk full)."""
    spool = Path(spool)
    if output is None:
        name = spool.name[: -len(SPOOL_SUFFIX)] if spool.name.endswith(SPOOL_SUFFIX) else spool.name + ".parquet"
        output = spool.with_name(name)
    return finalize(spool, Path(output), {"recovered": True, "complete": False}, force=force)
