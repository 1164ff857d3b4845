"""The collector side of a probe: which BPF source it is, what it needs from the kernel,
and how its raw ring-buffer records become trace rows.

Records are copied out of the ring buffer as raw bytes and decoded in batches with numpy,
using a dtype built from the event struct that bcc parsed out of the C source (the C
struct is the only declaration).
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.settings import Settings
from trainbpf.tracer.source import Source

# Index of each probe's lost-event counter in the BPF `lost` array: declared here only,
# the loader passes them to the C as -D PROBE_<NAME> and PROBE_COUNT (probes/common.h).
PROBE_IDS = {
    "sched": 0,
    "task": 1,
    "futex": 2,
    "faults": 3,
    "oncpu": 4,
    "mm": 5,
    "writeback": 6,
    "block": 7,
    "cuda": 8,
    "nccl": 9,
    "writepath": 10,
    "pagecache": 11,
    "disk": 12,
    "net": 13,
    "tlb": 14,
}


def probe_defines() -> dict[str, int]:
    """-D defines of the lost-counter indexes (PROBE_SCHED, ...) and PROBE_COUNT."""
    return {**{f"PROBE_{name.upper()}": i for name, i in PROBE_IDS.items()}, "PROBE_COUNT": len(PROBE_IDS)}


def ctypes_to_dtype(cls: type[ctypes.Structure]) -> np.dtype:
    """numpy dtype with the exact layout of a bcc-generated event class."""
    dtype = np.dtype(cls)
    if dtype.itemsize != ctypes.sizeof(cls):
        raise AssertionError(f"{cls.__name__}: dtype {dtype.itemsize} != C {ctypes.sizeof(cls)}")
    return dtype


def cstrings(arr: np.ndarray) -> list[str]:
    """Fixed-size C char arrays to str, cut at the first NUL.  bcc's ctypes classes make
    char[N] an (N,) array of S1, which we view as one SN string per record."""
    if arr.ndim == 2:
        arr = np.ascontiguousarray(arr).view(f"S{arr.shape[1]}").reshape(-1)
    return [b.split(b"\0", 1)[0].decode(errors="replace") for b in arr.tolist()]


def stack_ids(arr: np.ndarray) -> np.ndarray:
    """Stack ids with failures (negative errno) as -1."""
    return np.where(arr >= 0, arr, -1).astype(np.int32)


def py_stack_ids(arr: np.ndarray) -> pa.Array:
    """Python stack ids (probes/pyframes.h), null where none was walked."""
    return pa.array(arr.astype(np.int32), mask=arr < 0)


class Collector(Source):
    """Base class: one probe's source, requirements and decoding.  As a recording's
    Source (tracer/source.py) its rows are the traced threads' events: at each flush,
    what its ring buffers hold and its in-kernel aggregates."""

    described = True
    source: ClassVar[str | None]  # file under probes/; None: the collector reads no BPF
    tracepoints: ClassVar[tuple[str, ...]] = ()  # "category:event" the probe needs
    optional_tracepoints: ClassVar[tuple[str, ...]] = ()  # compiled in when present
    # Bare tracepoints (no tracefs entry), attached as raw tracepoints when present.
    optional_raw_tracepoints: ClassVar[tuple[str, ...]] = ()
    ringbufs: ClassVar[tuple[str, ...]] = ()
    # Fields its programs read at offsets the loader takes from tracefs' format files, as
    # -D <EVENT>_<FIELD>_AT: of a tracepoint whose TRACEPOINT_PROBE name (and bcc's struct
    # of its fields) another probe holds.
    fields_at: ClassVar[dict[str, tuple[str, ...]]] = {}
    uprobes: ClassVar[bool] = False  # attaches uprobes (to libraries found while recording), no tracepoints
    # Recorded only when `--probes` names it: it costs too much for every recording.
    opt_in: ClassVar[bool] = False
    notice: Callable[[str], None] | None = None  # one-line news for the user (record sets it)

    def __init__(self, settings: Settings):
        self.settings = settings

    def defines(self) -> dict[str, int | str]:
        """-D defines for the probe's C: its settings and the constants both sides share."""
        return {}

    def attach(self, bpf) -> None:
        """Attach what bcc does not attach by itself (tracepoints attach on load)."""

    def decode(self, ringbuf: str, records: np.ndarray) -> list[pa.RecordBatch]:
        raise NotImplementedError

    def on_batch(self, ringbuf: str, records: np.ndarray, threads: ThreadTable) -> None:
        """Each batch of records taken from one of the probe's ring buffers, before it is
        decoded: what the recorder's thread table learns from it."""

    def take(self, rings, threads: ThreadTable) -> list[pa.RecordBatch]:
        """The rows of the records waiting in the probe's ring buffers (read by `rings`)."""
        batches: list[pa.RecordBatch] = []
        for rb in self.ringbufs:
            records = rings.take(rb)
            if records is not None and len(records):
                self.on_batch(rb, records, threads)
                batches += self.decode(rb, records)
        return batches

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        """Read and reset in-kernel aggregates; `final` at the end of the recording."""
        return []

    def seeded(self, bpf, walked: list, threads: ThreadTable, now_ns: int) -> None:
        """The traced tree at the start (`walked`: proctree.ThreadInfo), once seeded at `now_ns`."""

    def still_open(self, bpf, threads: ThreadTable, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        """What is still open in the kernel at `now_ns`: at every flush but the last
        (`final` False) what a killed recording's segment would miss, at the stop
        (`final` True) what ends with the recording."""
        return []

    def forget(self, bpf, tids: list[int]) -> None:
        """Threads that exited, whose records are drained: what the probe's maps hold
        for them can go."""

    # -- the Source hooks, in the probe's terms above ---------------------------------
    def open(self, session) -> None:
        super().open(session)
        self.notice = session.notice

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        session = self.session
        self.seeded(session.bpf, walked, session.threads, session.start_ns)
        return []

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        session = self.session
        return self.take(session.rings, session.threads) + self.drain(session.bpf, now_ns, final=final)

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        session = self.session
        return ended + self.still_open(session.bpf, session.threads, now_ns, final=final)

    def exited(self, tids: list[int]) -> None:
        self.forget(self.session.bpf, tids)


@dataclass
class ThreadTable:
    """The recording's threads: every tid seen (-> its tgid), those that exited, and who
    is told of an exec (a process's address space is replaced)."""

    tgid: dict[int, int] = field(default_factory=dict)
    exited: set[int] = field(default_factory=set)
    exec_listeners: list[Callable[[], None]] = field(default_factory=list)
    # Told of threads (proctree.ThreadInfo) that join after the start, at a time: a process
    # let back in after its exec (tracer/access.py).
    join_listeners: list[Callable[[list, int], None]] = field(default_factory=list)
    unforgotten: list[int] = field(default_factory=list)  # exited, still in the probes' maps
    exit_log: list[int] = field(default_factory=list)  # exited tids in order: a reader keeps its place
    exec_log: list[tuple[int, int, int, str]] = field(default_factory=list)  # execs: (tid, pid, ts_ns, comm)
    untraced: set[int] = field(default_factory=set)  # processes taken out of the traced set (tracer/access.py)
    _live: dict[int, int] = field(default_factory=dict, repr=False)
    _live_stamp: tuple[int, int] = field(default=(-1, -1), repr=False)

    def exit(self, tid: int) -> None:
        if tid not in self.exited:
            self.exited.add(tid)
            self.unforgotten.append(tid)
            self.exit_log.append(tid)

    def live(self) -> dict[int, int]:
        """tid -> tgid of the threads not known to have exited; the caller must not
        change it.  Kept until a thread is added or exits: `tgid` and `exited` only grow,
        so their sizes tell, and a long recording's thousands of exited workers are not
        walked at every 100 ms sample (~1 ms for 40,000)."""
        stamp = (len(self.tgid), len(self.exited))
        if stamp != self._live_stamp:
            self._live = {tid: tg for tid, tg in self.tgid.items() if tid not in self.exited}
            self._live_stamp = stamp
        return self._live

    def tgids(self) -> list[int]:
        return sorted(set(self.tgid.values()) - self.untraced)

    def exec_seen(self) -> None:
        for listener in self.exec_listeners:
            listener()

    def joined(self, threads: list, now_ns: int) -> None:
        for listener in self.join_listeners:
            listener(threads, now_ns)


def bucket_batches(kind: str, rows: list[tuple], width: int, *, counted: str, first_ns: bool = False,
                   extra: dict[str, Callable[[np.ndarray], object]] | None = None) -> list[pa.RecordBatch]:
    """`kind` rows of per-thread counts in time buckets `width` ns wide, as a probe's hash
    holds them: `rows` are (bucket, tid, pid, count, *more) tuples; the count is the
    kind's column `counted`.  With `first_ns` the
    first of `more` is the time of the bucket's first event: a row then spans from it to
    the bucket's end.  `extra` names each further column and converts its int64 values."""
    if not rows:
        return []
    bucket, tid, pid, count, *more = (np.array(col, dtype=np.int64) for col in zip(*rows))
    start = bucket * width
    if first_ns:
        first, *more = more
        start = np.clip(first, start, start + width - 1)  # inside its bucket, whatever the clock said
    columns = {
        "ts_ns": start,
        "dur_ns": (bucket + 1) * width - start,
        "tid": tid.astype(np.int32),
        "pid": pid.astype(np.int32),
        counted: count,
    }
    for (name, convert), values in zip((extra or {}).items(), more):
        columns[name] = convert(values)
    return [make_batch(kind, columns)]


BATCH_ENTRIES = 4096  # entries one batch call moves; its buffers are reused from flush to flush


def drain_hash(table) -> tuple[np.ndarray, np.ndarray]:
    """Every key and value of a BPF hash, as numpy arrays of its Key and Leaf layouts,
    deleting what was read.

    Batch lookup-and-delete is atomic per entry, so nothing counted between the read and
    the delete is lost.  bcc's own batch call allocates arrays for the map's every entry
    on each call (~0.25 ms for a 65536-entry map, several maps at every flush), so the
    arrays here are allocated once per map, BATCH_ENTRIES at a time."""
    try:
        return _batches(table, delete=True)
    except (OSError, AttributeError):  # kernels (or a libbcc) or maps without batch ops: read then delete per key
        items = list(table.items())
        for key, _ in items:  # only what was read: an entry added since stays for the next drain
            try:
                del table[key]
            except KeyError:
                pass
        return _item_records(table, items)


def delete_keys(table, keys) -> None:
    """Remove the entries of a BPF hash keyed by an integer for `keys`; absent ones are
    skipped."""
    for k in keys:
        try:
            del table[table.Key(k)]
        except KeyError:
            pass


def read_hash(table) -> tuple[np.ndarray, np.ndarray]:
    """Every key and value of a BPF hash, as drain_hash gives them, left in the map.
    Entries added or removed meanwhile may be missed or seen."""
    try:
        return _batches(table, delete=False)
    except (OSError, AttributeError):
        return _item_records(table, list(table.items()))


def lookup_keys(table, keys) -> tuple[np.ndarray, np.ndarray]:
    """The entries of a BPF hash keyed by an integer for `keys` (those present), as
    read_hash gives them: one lookup each, for a few keys in a large map, where a batch
    read would walk every one of its buckets (~0.3-0.5 ms for 65536 at each flush)."""
    from bcc.libbcc import lib

    key, leaf = table.Key(), table.Leaf()
    found_keys, found_values = [], []
    for k in keys:
        key.value = k
        if lib.bpf_lookup_elem(table.map_fd, ctypes.byref(key), ctypes.byref(leaf)) == 0:
            found_keys.append(table.Key(k))
            found_values.append(bytes(leaf))
    return _records(table.Key, found_keys), _records(table.Leaf, found_values)


def _item_records(table, items: list) -> tuple[np.ndarray, np.ndarray]:
    """bcc's (key, value) pairs of `table` as its Key and Leaf arrays."""
    return _records(table.Key, [k for k, _ in items]), _records(table.Leaf, [v for _, v in items])


def _records(ctype: type, items: list) -> np.ndarray:
    """ctypes values (or their bytes) of one layout, as a numpy array of that layout."""
    dtype = ctypes_to_dtype(ctype)
    return np.frombuffer(b"".join(bytes(i) for i in items), dtype=dtype) if items else np.zeros(0, dtype)


def _batches(table, *, delete: bool) -> tuple[np.ndarray, np.ndarray]:
    from bcc.libbcc import lib

    # Kept on bcc's table object (one per map and BPF object), typed by its own Key and
    # Leaf: a map descriptor is reused by a later recording's maps, of other layouts.
    bufs = getattr(table, "_trainbpf_batch", None)
    if bufs is None:
        n = min(table.max_entries, BATCH_ENTRIES)
        keys, values = (table.Key * n)(), (table.Leaf * n)()
        bufs = table._trainbpf_batch = (keys, values, np.frombuffer(keys, dtype=ctypes_to_dtype(table.Key)),
                                        np.frombuffer(values, dtype=ctypes_to_dtype(table.Leaf)))
    keys, values, key_view, value_view = bufs
    call = lib.bpf_lookup_and_delete_batch if delete else lib.bpf_lookup_batch
    token, count = ctypes.c_uint32(0), ctypes.c_uint32(0)
    out_keys, out_values = [], []
    first = True
    while True:
        count.value = len(keys)
        res = call(table.map_fd, None if first else ctypes.byref(token), ctypes.byref(token),
                   ctypes.byref(keys), ctypes.byref(values), ctypes.byref(count))
        err = ctypes.get_errno()
        out_keys.append(key_view[: count.value].copy())
        out_values.append(value_view[: count.value].copy())
        if res != 0:
            if err == errno.ENOENT:  # the whole map is read
                break
            raise OSError(err, f"BPF map batch {'lookup-and-delete' if delete else 'lookup'}: {os.strerror(err)}")
        first = False
    if len(out_keys) == 1:
        return out_keys[0], out_values[0]
    return np.concatenate(out_keys), np.concatenate(out_values)


def array_values(table) -> np.ndarray:
    """Every value of a BPF array, in index order, as a numpy array of its Leaf layout: one
    batch read where supported.  bcc's own batch read makes a Python object of each entry,
    ~50 ms for 16384 records."""
    try:
        return _batches(table, delete=False)[1]
    except (OSError, AttributeError):  # kernels without batch ops on arrays
        return _records(table.Leaf, list(table.values()))
