"""Naming stack ids.  Kernel stacks are named as they come (the wake-up chains need to
know which came from interrupt context).  User frames are placed in their files while
the processes live, with each process's maps kept from when its stacks are first seen
and each file holding a frame opened then; they are named after the stop, as bcc's
offcputime does, so a process that exits before the stop (a forked DataLoader worker)
is named from what was kept, and naming costs nothing while the workload runs."""

from __future__ import annotations

import ctypes
import itertools
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.symbols.anon import AnonymousCode
from trainbpf.tracer.symbols.elf import FUNCTION_KINDS, ElfSymbols, symbol_tables
from trainbpf.tracer.symbols.maps import MapsIndex, Mapping, ProcMaps, open_if_mapped, open_mapped

MAX_CACHED_NAMES = 65536
MAX_HELD_FILES = 512  # descriptors kept open; beyond, a file is opened again to be named (_reopen)
MMAP_MIN_ADDR = 65536  # vm.mmap_min_addr's default; no user mapping starts lower
# A wake-up whose kernel stack holds one of these ran in interrupt context (a timer
# expiring, an I/O completing): `current` there is whoever was interrupted, not a waker.
IRQ_FRAMES = ("asm_sysvec_", "asm_common_interrupt", "__sysvec_", "sysvec_", "hrtimer_interrupt",
              "__hrtimer_run_queues", "handle_softirqs", "__do_softirq", "do_softirq", "irq_exit")

# A frame placed while its process lived: its final name, or (device, inode, offset in
# the file) to be named after the stop.
Frame = str | tuple[str, int, int]


class StackSymbolizer:
    def __init__(self, bpf, proc: str = "/proc"):
        self.bpf = bpf
        self.proc = proc
        self.done_kernel: set[int] = set()
        self.done_user: set[tuple[int, int]] = set()
        self.irq_ids: set[int] = set()  # kernel stacks taken in interrupt context
        self._irq_array: pa.Array | None = None
        # Symbol names by address: the same frames recur in stack after stack, and each
        # lookup costs bcc time (docs/performance.md, "Costs the code is shaped by").
        self._kernel_names: dict[int, str] = {}
        self._user_frames: dict[tuple[int, int], Frame] = {}  # (pid, addr); cleared on exec
        self._maps: dict[int, MapsIndex | None] = {}  # as first seen; re-read on a miss
        self.files = MappedFiles(proc)
        self.anon = AnonymousCode(proc)
        self._pending: list[tuple[int, int, list[Frame]]] = []  # (stack id, pid, frames)

    def _ips(self, stack_id: int) -> list[int]:
        table = self.bpf["stacks"]
        try:
            ips = table[table.Key(stack_id)].ip  # Settings.stack_frames long (probes/common.h)
        except KeyError:
            return []
        # Not bcc's walk(): it assumes 127-frame values.  A stack ends at the first 0.
        return list(itertools.takewhile(bool, ips))

    def symbolize(self, kernel_ids, user_pairs, maps: ProcMaps | None = None) -> pa.RecordBatch | None:
        """Rows for kernel ids not seen before; user (id, pid) pairs not seen before are
        placed in their files now and named by finish().  `maps`: this flush's process
        mappings."""
        maps = maps if maps is not None else ProcMaps(self.proc)
        rows = []
        for sid in set(np.asarray(kernel_ids, dtype=np.int64).tolist()) - self.done_kernel:
            if sid < 0:
                continue
            self.done_kernel.add(sid)
            frames = ";".join(self._ksym(a) for a in self._ips(sid))
            if any(f.startswith(IRQ_FRAMES) for f in frames.split(";")):
                self.irq_ids.add(sid)
            rows.append((sid, "kernel", 0, frames))
        refreshed: set[int] = set()  # pids whose maps this flush has re-read
        for sid, pid in set(map(tuple, np.asarray(user_pairs, dtype=np.int64).tolist())) - self.done_user:
            if sid < 0:
                continue
            self.done_user.add((sid, pid))
            self._pending.append((sid, pid, [self._place(a, pid, maps, refreshed) for a in self._ips(sid)]))
        return _stack_batch(rows)

    def irq_id_array(self) -> pa.Array:
        """irq_ids as an int32 array (for drop_irq_wakers), remade only when one is new."""
        if self._irq_array is None or len(self._irq_array) != len(self.irq_ids):
            self._irq_array = pa.array(sorted(self.irq_ids), type=pa.int32())
        return self._irq_array

    def finish(self, ts_ns: int | None = None) -> pa.RecordBatch | None:
        """The user stacks placed so far, named (after the stop: the files are held);
        their rows at `ts_ns` (the recording's end), else now."""
        rows = [(sid, "user", pid, ";".join(f if isinstance(f, str) else self.files.name(f) for f in frames))
                for sid, pid, frames in self._pending]
        self._pending.clear()
        return _stack_batch(rows, ts_ns)

    def close(self) -> None:
        self.files.close()

    def exec_seen(self) -> None:
        """A traced process exec'd: its addresses now mean other code."""
        self._user_frames.clear()
        self._maps.clear()

    def load_kernel_symbols(self) -> None:
        """bcc reads /proc/kallsyms on its first kernel lookup (~0.1 s): done at start-up,
        with the compile, not in the first second of tracing."""
        self.bpf.ksym(0)

    def _ksym(self, addr: int) -> str:
        name = self._kernel_names.get(addr)
        if name is None:
            if len(self._kernel_names) >= MAX_CACHED_NAMES:  # stays bounded over long recordings
                self._kernel_names.clear()
            name = self._kernel_names[addr] = self.bpf.ksym(addr).decode(errors="replace")
        return name

    def _place(self, addr: int, pid: int, maps: ProcMaps, refreshed: set[int]) -> Frame:
        frame = self._user_frames.get((pid, addr))
        if frame is None:
            frame = self._where(addr, pid, maps, refreshed)
            if not isinstance(frame, _Stray):
                if len(self._user_frames) >= MAX_CACHED_NAMES:
                    self._user_frames.clear()
                self._user_frames[(pid, addr)] = frame
        return frame

    def _where(self, addr: int, pid: int, maps: ProcMaps, refreshed: set[int]) -> Frame:
        """Where a user address lies: in a file's mapping, (device, inode, offset in the
        file); the file by device and inode, not by path: in another mount namespace (a
        container) the same path can be another file.  Below mmap_min_addr or outside
        the process's executable memory: a frame-pointer walk gone astray, not a return
        address, left as a number.  Code in no file (a JIT's, the vdso) or a process
        gone before its maps were read: named now (anon.py), or left as a number."""
        if addr < MMAP_MIN_ADDR:
            return _raw(addr)
        index = self._maps.get(pid)
        i = index.index_of(addr) if index is not None else -1
        # Not in known code: the process first seen, or a library loaded since, unless a
        # walk gone astray read the address (re-reading the maps, ~1.5 ms, would not
        # place it): it lies in a known mapping of data (heap, a stack), or above the top
        # of user space, where nothing new is mapped.
        if not _is_code(index, i) and pid not in refreshed and (index is None or index.may_map_later(addr, i)):
            refreshed.add(pid)
            fresh = maps.of(pid)
            if fresh is not None or index is None:
                index = self._maps[pid] = fresh
                i = index.index_of(addr) if index is not None else -1
        if index is None:
            return self._anonymous_name(addr, pid, None)
        if not _is_code(index, i):
            return _raw(addr)
        m = index.maps[i]
        if m.path.startswith("/") and m.file[1] and self.files.hold(pid, m):
            return (*m.file, addr - m.start + m.offset)
        return self._anonymous_name(addr, pid, m)

    def _anonymous_name(self, addr: int, pid: int, m: Mapping | None) -> str:
        return self.anon.name(addr, pid, m) or f"0x{addr:x}"


def _is_code(index: MapsIndex | None, i: int) -> bool:
    """Whether mapping `i` of `index` (index_of's answer, -1 for none) holds code."""
    return i >= 0 and index.maps[i].executable


class _Stray(str):
    """A frame left as a number: an address no mapping holds as code (a walk gone astray).
    Such addresses rarely recur, and are not kept in the symboliser's cache."""


def _raw(addr: int) -> _Stray:
    return _Stray(f"0x{addr:x}")


def _stack_batch(rows: list[tuple[int, str, int, str]], ts_ns: int | None = None) -> pa.RecordBatch | None:
    if not rows:
        return None
    return make_batch("stack", {
        "ts_ns": np.full(len(rows), time.monotonic_ns() if ts_ns is None else ts_ns, dtype=np.int64),
        "stack_id": np.array([r[0] for r in rows], dtype=np.int32),
        "space": [r[1] for r in rows],
        "pid": np.array([r[2] for r in rows], dtype=np.int32),
        "frames": [r[3] for r in rows],
    })


class MappedFiles:
    """The files holding traced code, each opened when a frame is first placed in it
    (through /proc/PID/map_files, so the very file mapped, whatever the process's mount
    namespace, and still there after it exits or the file is replaced), and named from
    its ELF symbols (and its separate debug file's, found by build-id or debuglink) as
    bcc names them: "function [file]", "[unknown] [file]" where no function covers the
    address."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self._opened: dict[tuple[str, int], tuple[str, int | None]] = {}  # file -> (path, fd)
        self._unheld: dict[tuple[str, int], tuple[int, Mapping]] = {}  # file -> where it was mapped, when no fd is held
        self._symbols: dict[tuple[str, int], list[ElfSymbols]] = {}
        self._names: dict[tuple[str, int, int], str] = {}

    def hold(self, pid: int, m: Mapping) -> bool:
        if m.file in self._opened:
            return True
        fd = None
        if sum(1 for _, f in self._opened.values() if f is not None) < MAX_HELD_FILES:
            try:
                fd = open_mapped(pid, m, self.proc)
            except OSError:
                return False
        self._opened[m.file] = (m.path, fd)
        if fd is None:
            self._unheld[m.file] = (pid, m)
        return True

    def name(self, frame: tuple[str, int, int]) -> str:
        name = self._names.get(frame)
        if name is None:
            dev, inode, offset = frame
            path, _ = self._opened[(dev, inode)]
            elfs = self._elfs((dev, inode))
            # The file's own segments place the offset (a debug file's hold no bytes).
            vaddr = elfs[-1].file_vaddr(offset) if elfs else None
            function = next((f for f in (e.function(vaddr) for e in elfs) if f), None) if vaddr is not None else None
            if len(self._names) >= MAX_CACHED_NAMES:
                self._names.clear()
            name = self._names[frame] = f"{demangle(function) if function else '[unknown]'} [{os.path.basename(path)}]"
        return name

    def _elfs(self, file: tuple[str, int]) -> list[ElfSymbols]:
        """The file's symbol tables, its separate debug file's first, the file's own last."""
        if file not in self._symbols:
            path, fd = self._opened[file]
            opened = fd if fd is not None else self._reopen(file)
            self._symbols[file] = [] if opened is None else symbol_tables(f"/proc/self/fd/{opened}", path, FUNCTION_KINDS,
                                                                          every_table=True)
            if fd is None and opened is not None:
                os.close(opened)
        return self._symbols[file]

    def _reopen(self, file: tuple[str, int]) -> int | None:
        """A file not held open, opened again to be named: through its process while
        that lives, else by its path while that still leads to the very file (in a
        container the host's file at that path is another); None: no names."""
        pid, m = self._unheld[file]
        try:
            return open_mapped(pid, m, self.proc)
        except OSError:
            pass
        try:
            return open_if_mapped(m.path, m)
        except OSError:
            return None

    def close(self) -> None:
        for _, fd in self._opened.values():
            if fd is not None:
                os.close(fd)
        self._opened.clear()
        self._unheld.clear()
        self._symbols.clear()


def _cxa_demangle():
    try:
        fn = ctypes.CDLL("libstdc++.so.6").__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return fn


_DEMANGLE = _cxa_demangle()
_FREE = ctypes.CDLL(None).free
_FREE.argtypes = [ctypes.c_void_p]


def demangle(name: str) -> str:
    """A C++ name as written (bcc demangles too); others as they are."""
    if not name.startswith("_Z") or _DEMANGLE is None:
        return name
    status = ctypes.c_int(0)
    out = _DEMANGLE(name.encode(), None, None, ctypes.byref(status))
    if not out:
        return name
    try:
        return ctypes.string_at(out).decode(errors="replace") if status.value == 0 else name
    finally:
        _FREE(out)


def drop_irq_wakers(batch: pa.RecordBatch, irq_ids: pa.Array) -> pa.RecordBatch:
    """Null the waker of wake-ups that came from interrupt context (kernel stack ids
    `irq_ids`, StackSymbolizer.irq_id_array); their peer_kstack_id stays and shows what
    woke the thread (timer, I/O completion)."""
    names = batch.schema.names
    peer_k = batch.column(names.index("peer_kstack_id"))
    if not len(irq_ids) or peer_k.null_count == len(peer_k):
        return batch
    mask = pc.fill_null(pc.is_in(peer_k, irq_ids), False)
    if not pc.any(mask).as_py():
        return batch
    cols = list(batch.columns)
    for col in ("peer_tid", "peer_pid", "peer_pystack_id"):
        i = names.index(col)
        cols[i] = pc.if_else(mask, pa.nulls(len(mask), cols[i].type), cols[i])
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def kernel_refs(batch: pa.RecordBatch) -> np.ndarray:
    """The distinct kernel stack ids a decoded batch refers to."""
    ids = [_valid_ids(batch, column)[0] for column in ("kstack_id", "peer_kstack_id")]
    ids = [i for i in ids if len(i)]
    return sorted_unique(np.concatenate(ids)) if ids else np.empty(0, np.int64)


def user_refs(batch: pa.RecordBatch) -> np.ndarray:
    """The distinct (user stack id, pid) pairs a decoded batch refers to (a waker's user
    stack is not taken: probes/sched.bpf.c)."""
    ids, keep = _valid_ids(batch, "ustack_id")
    if not len(ids):
        return np.empty((0, 2), np.int64)
    pids = pc.fill_null(batch.column(batch.schema.get_field_index("pid")), 0).to_numpy()
    return _unique_pairs(np.stack([ids, pids[keep].astype(np.int64)], axis=1))


def _valid_ids(batch: pa.RecordBatch, column: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A stack id column's ids (nulls and failures left out) and where they are; most
    kinds of rows carry no stacks, and leave both empty."""
    arr = batch.column(batch.schema.get_field_index(column))
    if arr.null_count == len(arr):
        return np.empty(0, np.int64), None
    ids = pc.fill_null(arr, -1).to_numpy()
    keep = ids >= 0
    return ids[keep].astype(np.int64), keep


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for 1-D values by sorting: numpy 2.4's np.unique is much slower
    (docs/performance.md, "Costs the code is shaped by")."""
    values = np.sort(values, kind="stable")
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


def _unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """np.unique(pairs, axis=0) for (stack id, pid) rows: each row packed into one
    64-bit key (both fit 32 bits), so the sort is a plain 1-D one."""
    pairs = pairs.astype(np.int64)
    keys = sorted_unique((pairs[:, 0] << 32) | (pairs[:, 1] & 0xFFFFFFFF))
    return np.stack([keys >> 32, keys & 0xFFFFFFFF], axis=1)
