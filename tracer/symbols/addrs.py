"""What a futex address is: the region of the process it lies in and, inside a program or
library image, the data symbol that holds it.

User stacks rarely say which lock a thread waited on (libc and the Python interpreter
are built without frame pointers, so the walk stops at the futex call), but the address
does: one inside the interpreter's `_PyRuntime` is the GIL, one inside libc's
`main_arena` is the allocator's lock, one in a /dev/shm file is a lock shared between
processes (a multiprocessing queue).  Addresses are described while the processes are
alive, once per (process, address), and travel in the trace as `futex_addr` rows.
"""


from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.symbols.elf import OBJECT_KINDS, ElfSymbols, symbol_tables
from trainbpf.tracer.symbols.maps import Mapping, MapsIndex, ProcMaps, open_mapped

MAX_DESCRIBED = 65536  # (pid, addr) pairs remembered; cleared beyond, like the stack caches
MAX_IMAGES = 64  # ELF symbol tables kept


def futex_pairs(batch: pa.RecordBatch) -> np.ndarray:
    """The distinct (pid, addr) pairs of the futex rows in `batch`, as int64."""
    futex = pc.equal(batch.column(batch.schema.get_field_index("kind")), "futex")
    if not batch.num_rows or not pc.any(futex).as_py():
        return np.zeros((0, 2), np.int64)
    rows = batch.filter(futex)
    pid = rows.column(batch.schema.get_field_index("pid")).to_numpy(zero_copy_only=False).astype(np.int64)
    addr = rows.column(batch.schema.get_field_index("addr")).to_numpy(zero_copy_only=False).astype(np.uint64)
    return unique_rows(np.stack([pid, addr.view(np.int64)], axis=1))


def unique_rows(pairs: np.ndarray) -> np.ndarray:
    """np.unique(pairs, axis=0) of two int64 columns, by one sort: numpy 2.4's np.unique
    with an axis takes ~5x as long (90 against 20 us for a flush's 250 futex rows)."""
    pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
    distinct = np.ones(len(pairs), dtype=bool)
    distinct[1:] = (pairs[1:] != pairs[:-1]).any(axis=1)
    return pairs[distinct]



class AddressDescriber:
    """Describes each new (pid, futex address) once, while the process is alive."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.done: set[tuple[int, int]] = set()
        self._images: dict[tuple[str, int], list[ElfSymbols] | None] = {}  # (device, inode) -> symbol_tables
        # Each process's mappings as last read: re-read (~1.5 ms) only for an address in
        # none of them.  A mapping replaced in place is described as it was.
        self._maps: dict[int, MapsIndex] = {}

    def describe(self, pairs: np.ndarray, maps: ProcMaps | None = None) -> pa.RecordBatch | None:
        """Rows for the (pid, addr) pairs not described before; `maps`: this flush's."""
        maps = maps if maps is not None else ProcMaps(self.proc)
        rows = []
        by_pid: dict[int, list[int]] = {}
        for pid, addr in pairs.tolist() if len(pairs) else []:
            addr &= (1 << 64) - 1  # int64 pairs carry the address's bits
            if (pid, addr) not in self.done:
                by_pid.setdefault(pid, []).append(addr)
        for pid, addrs in by_pid.items():
            index = self._maps.get(pid)
            if index is None or any(index.may_map_later(a) for a in addrs):  # first seen, or mapped since
                index = self._maps[pid] = maps.of(pid) or MapsIndex([])  # gone: unknown, not retried
            if len(self.done) + len(addrs) > MAX_DESCRIBED:
                self.done.clear()
            for addr in addrs:
                self.done.add((pid, addr))
                region, name = self._region(pid, index, addr)
                rows.append((pid, addr, region, name))
        if not rows:
            return None
        return make_batch("futex_addr", {
            "ts_ns": np.full(len(rows), time.monotonic_ns(), dtype=np.int64),
            "pid": np.array([r[0] for r in rows], dtype=np.int32),
            "addr": np.array([r[1] for r in rows], dtype=np.uint64),
            "state": [r[2] for r in rows],
            "name": [r[3] for r in rows],
        })

    def exec_seen(self) -> None:
        """A traced process exec'd: its addresses now mean other things."""
        self.done.clear()
        self._maps.clear()

    def _region(self, pid: int, index: MapsIndex, addr: int) -> tuple[str, str]:
        """(region, name): region is image, heap, stack, shared, file, anon or unknown."""
        i = index.index_of(addr)
        if i < 0:
            return "unknown", ""
        maps = index.maps
        m = maps[i]
        if m.path == "[heap]":
            return "heap", "[heap]"
        if m.path.startswith("[stack"):
            return "stack", m.path
        if m.shared or m.path.startswith(("/dev/shm/", "/memfd:")):
            return "shared", m.path or "[shared]"
        # A program's or library's data; its .bss may go on in an anonymous mapping
        # right after the file's last one.
        image = m.path if m.path.startswith("/") else ""
        if not m.path and i > 0 and maps[i - 1].path.startswith("/") and maps[i - 1].end == m.start:
            image = maps[i - 1].path
        if image:
            found = self._symbol(pid, maps, image, addr)
            if found is not None:
                return "image", found
        if m.path.startswith("/"):
            return "file", m.path
        return "anon", m.path or "[anon]"

    def _symbol(self, pid: int, maps: list[Mapping], path: str, addr: int) -> str | None:
        elfs = self._elf(pid, next(m for m in maps if m.path == path))
        if elfs is None:
            return None
        elf = elfs[-1]  # the file's own: where its segments are placed
        base = min((m.start - m.offset for m in maps if m.path == path), default=0)
        vaddr = addr if elf.is_exec else addr - base + elf.first_vaddr
        if not elf.first_vaddr <= vaddr < elf.end_vaddr:
            return None
        short = os.path.basename(path)
        sym = next((found for found in (e.symbol(vaddr) for e in elfs) if found), None)
        if sym is None:
            return f"{short}+0x{vaddr:x}"
        name, off = sym
        return f"{name}+0x{off:x} [{short}]"

    def _elf(self, pid: int, m: Mapping) -> list[ElfSymbols] | None:
        """The symbol tables of the file mapped at `m` (open_mapped: the very file, also in
        a container; its debug file's first), None where it cannot be read or is malformed."""
        if m.file not in self._images:
            if len(self._images) >= MAX_IMAGES:
                self._images.clear()
            try:
                fd = open_mapped(pid, m, self.proc)
            except OSError:
                return None  # not kept: a later flush may open it
            try:
                # A lock's library may have its debug file fetched (a few libraries hold the
                # locks waited on); stacks.py's functions, in every library, never are.
                self._images[m.file] = symbol_tables(f"/proc/self/fd/{fd}", m.path, OBJECT_KINDS, fetch=True) or None
            finally:
                os.close(fd)
        return self._images[m.file]
