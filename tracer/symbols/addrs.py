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

import bisect
import errno
import mmap
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.trace.spool import make_batch

MAX_DESCRIBED = 65536  # (pid, addr) pairs remembered; cleared beyond, like the stack caches
MAX_IMAGES = 64  # ELF symbol tables kept

_ELF64_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                       ("value", "<u8"), ("size", "<u8")])
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_SHT_NOTE, _SHT_NOBITS = 7, 8
_STT_OBJECT, _STT_FUNC, _STT_TLS, _STT_GNU_IFUNC = 1, 2, 6, 10
OBJECT_KINDS = (_STT_OBJECT, _STT_TLS)
FUNCTION_KINDS = (_STT_FUNC, _STT_GNU_IFUNC)  # what bcc names code with
_PT_LOAD = 1
_ET_EXEC = 2
_EHDR_SIZE, _PHDR_SIZE, _SHDR_SIZE = 64, 56, 64  # Elf64 header, program and section header sizes


def _within(data, offset: int, size: int, what: str) -> None:
    """Raise ElfError unless `size` bytes at `offset` lie inside the file."""
    if offset + size > len(data):
        raise ElfError(f"truncated or malformed ELF file: its {what} end past its {len(data)} bytes")


class ElfError(ValueError):
    """A file that says it is ELF but whose headers or tables lie outside it (truncated or
    malformed): nothing is read from it."""


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    shared: bool
    offset: int
    path: str  # "" for an anonymous mapping
    file: tuple[str, int] = ("", 0)  # (device, inode): which file, whatever the mount namespace
    executable: bool = False


def parse_maps(text: str) -> list[Mapping]:
    """/proc/PID/maps lines, in address order."""
    out = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        lo, hi = parts[0].split("-")
        out.append(Mapping(int(lo, 16), int(hi, 16), parts[1][3:4] == "s", int(parts[2], 16),
                           parts[5].strip() if len(parts) > 5 else "", (parts[3], int(parts[4])),
                           parts[1][2:3] == "x"))
    return out


def open_mapped(pid: int, m: Mapping, proc: str = "/proc") -> int:
    """A read-only descriptor of the very file process `pid` maps at `m`.

    The process chose the file and may since have pointed its name elsewhere (at a
    root-only library, say): /proc/PID/map_files/START-END leads to the mapped inode
    whatever the name now leads to.  Where that cannot be opened (it needs
    CAP_SYS_ADMIN), the name, in the process's root.  Either only when the file opened is
    the mapping's (device, inode); OSError otherwise."""
    err: OSError = FileNotFoundError(m.path)
    for path in (f"{proc}/{pid}/map_files/{m.start:x}-{m.end:x}", f"{proc}/{pid}/root{m.path}"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            err = exc
            continue
        st = os.fstat(fd)
        major, minor = (int(x, 16) for x in m.file[0].split(":"))
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == (major, minor, m.file[1]):
            return fd
        os.close(fd)
        err = OSError(errno.ESTALE, f"{m.path} is no longer the file mapped")
    raise err


class MapsIndex:
    """One process's mappings (parse_maps) and which one holds an address."""

    def __init__(self, maps: list[Mapping]):
        self.maps = maps
        self._starts = [m.start for m in maps]  # bisect: a numpy search per address costs ~10x
        stacks = [m.end for m in maps if m.path == "[stack]"]
        self._user_top = max(stacks) if stacks else 1 << 64

    def may_map_later(self, addr: int, index: int | None = None) -> bool:
        """Whether a mapping made since these were read could hold `addr`: it lies in no
        mapping and below the main stack (new mappings go below it; only the vsyscall page
        lies above), not in the kernel's half or beyond.  `index`: index_of(addr), if known."""
        return (self.index_of(addr) if index is None else index) < 0 and addr < self._user_top

    def index_of(self, addr: int) -> int:
        """The position in `maps` of the mapping holding `addr`, -1 if none does."""
        i = bisect.bisect_right(self._starts, addr) - 1
        return i if i >= 0 and addr < self.maps[i].end else -1


class ProcMaps:
    """Processes' /proc/PID/maps, each read at most once: one flush's worth, shared by
    the stack symboliser and the address describer (a later flush takes a new one and
    sees libraries loaded since)."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self._by_pid: dict[int, MapsIndex | None] = {}

    def of(self, pid: int) -> MapsIndex | None:
        """The process's mappings; None when it is gone."""
        if pid not in self._by_pid:
            try:
                with open(f"{self.proc}/{pid}/maps") as fh:
                    self._by_pid[pid] = MapsIndex(parse_maps(fh.read()))
            except OSError:
                self._by_pid[pid] = None
        return self._by_pid[pid]


class ElfSymbols:
    """The symbols of one ELF file of the given kinds (data objects by default), for
    address lookups.  Names are read from the string table only when looked up: a
    library's function table holds tens of thousands.

    Every ELF file the recorder reads comes through here, and the traced processes choose
    them: a file that is not 64-bit little-endian ELF has no symbols, and one whose
    headers or tables do not fit in it raises ElfError (a ValueError), never anything else."""

    def __init__(self, path: str, kinds: tuple[int, ...] = OBJECT_KINDS, *, every_table: bool = False):
        """`every_table`: both .symtab and .dynsym (as bcc names code), else .symtab when
        the file has one (unstripped) and .dynsym otherwise."""
        self.is_exec = False
        self.first_vaddr = 0
        self.end_vaddr = 0
        self.loads: list[tuple[int, int, int]] = []  # PT_LOAD (file offset, vaddr, file size)
        self.build_id = ""
        self.debuglink = ""
        self.value = np.zeros(0, np.uint64)
        self.size = np.zeros(0, np.uint64)
        self._name_at = np.zeros(0, np.int64)  # (table << 40) | offset in its string table
        self._strtabs: list[bytes] = []
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            self._parse(data, kinds, every_table)

    def _parse(self, data, kinds: tuple[int, ...], every_table: bool) -> None:
        if data[:4] != b"\x7fELF":
            return
        _within(data, 0, _EHDR_SIZE, "ELF header")
        if data[4:6] != b"\x02\x01":  # 64-bit little-endian only
            return
        e_type = int.from_bytes(data[16:18], "little")
        self.is_exec = e_type == _ET_EXEC
        phoff, shoff = int.from_bytes(data[32:40], "little"), int.from_bytes(data[40:48], "little")
        phentsize, phnum = int.from_bytes(data[54:56], "little"), int.from_bytes(data[56:58], "little")
        shentsize, shnum = int.from_bytes(data[58:60], "little"), int.from_bytes(data[60:62], "little")
        shstrndx = int.from_bytes(data[62:64], "little")
        if phnum:
            _within(data, phoff, phnum * max(phentsize, _PHDR_SIZE), "program headers")
        if shnum:
            _within(data, shoff, shnum * max(shentsize, _SHDR_SIZE), "section headers")
        loads = []
        for i in range(phnum):
            ph = phoff + i * phentsize
            if int.from_bytes(data[ph:ph + 4], "little") == _PT_LOAD:
                offset = int.from_bytes(data[ph + 8:ph + 16], "little")
                vaddr = int.from_bytes(data[ph + 16:ph + 24], "little")
                filesz = int.from_bytes(data[ph + 32:ph + 40], "little")
                memsz = int.from_bytes(data[ph + 40:ph + 48], "little")
                loads.append((vaddr, vaddr + memsz))
                self.loads.append((offset, vaddr, filesz))
        if loads:
            self.first_vaddr = min(v for v, _ in loads) & ~0xFFF
            self.end_vaddr = max(e for _, e in loads)
        sections = []
        for i in range(shnum):
            sh = shoff + i * shentsize
            sections.append((int.from_bytes(data[sh + 4:sh + 8], "little"),  # type
                             int.from_bytes(data[sh + 24:sh + 32], "little"),  # offset
                             int.from_bytes(data[sh + 32:sh + 40], "little"),  # size
                             int.from_bytes(data[sh + 40:sh + 44], "little"),  # link
                             int.from_bytes(data[sh:sh + 4], "little")))  # name
        self._debug_refs(data, sections, shstrndx)
        tables = [(typ, off, size, link) for typ, off, size, link, _ in sections
                  if typ in (_SHT_SYMTAB, _SHT_DYNSYM) and link < len(sections) and sections[link][0] != _SHT_NOBITS]
        for _, off, size, link in tables:  # all checked before any is viewed: a view would outlive an error
            _within(data, off, size, "symbol table")
            _within(data, sections[link][1], sections[link][2], "string table")
        values, sizes, names = [], [], []
        for wanted in (_SHT_SYMTAB, _SHT_DYNSYM):
            for typ, off, size, link in tables:
                if typ != wanted:
                    continue
                syms = np.frombuffer(data, dtype=_ELF64_SYM, count=size // _ELF64_SYM.itemsize, offset=off)
                kind = syms["info"] & 0xF
                keep = np.flatnonzero(np.isin(kind, kinds) & (syms["shndx"] != 0)
                                      & ((syms["size"] > 0) if kinds == OBJECT_KINDS else (syms["value"] > 0)))
                str_off, str_size = sections[link][1], sections[link][2]
                values.append(syms["value"][keep])
                sizes.append(syms["size"][keep])
                names.append((len(self._strtabs) << 40) | syms["name"][keep].astype(np.int64))
                self._strtabs.append(bytes(data[str_off:str_off + str_size]))
            if values and not every_table:
                break
        if values:
            value, size = np.concatenate(values), np.concatenate(sizes)
            order = np.argsort(value, kind="stable")
            self.value, self.size, self._name_at = value[order], size[order], np.concatenate(names)[order]

    def _debug_refs(self, data, sections, shstrndx: int) -> None:
        """The build-id note and the .gnu_debuglink name: where a stripped file's
        separate debug symbols are."""
        if shstrndx >= len(sections):
            return
        names_off = sections[shstrndx][1]
        for typ, off, size, _, name in sections:
            section = _cstring(data, names_off + name)
            if typ == _SHT_NOTE and section == b".note.gnu.build-id" and size >= 16:
                namesz, descsz = int.from_bytes(data[off:off + 4], "little"), int.from_bytes(data[off + 4:off + 8], "little")
                desc = off + 12 + ((namesz + 3) & ~3)
                self.build_id = bytes(data[desc:desc + descsz]).hex()
            elif section == b".gnu_debuglink":
                self.debuglink = _cstring(data, off).decode(errors="replace")

    def file_vaddr(self, file_offset: int) -> int | None:
        """The address as linked of a byte at `file_offset` in the file, None outside
        every loaded segment."""
        for offset, vaddr, filesz in self.loads:
            if offset <= file_offset < offset + filesz:
                return file_offset - offset + vaddr
        return None

    def named(self, pattern: str) -> list[tuple[str, int]]:
        """(name, address as linked) of each symbol read whose name matches `pattern`."""
        match = re.compile(pattern).match
        return [(name, int(self.value[i])) for i in range(len(self.value)) if match(name := self._name(i))]

    def address_of(self, name: str) -> int | None:
        """The address as linked of the symbol called `name` (of the kinds read), or None.
        String tables share tails ("_PyRuntime" may end "Foo_PyRuntime"), so every place
        the name ends a string is a candidate."""
        want = name.encode() + b"\0"
        keys = []
        for t, strtab in enumerate(self._strtabs):
            at = strtab.find(want)
            while at >= 0:
                keys.append((t << 40) | at)
                at = strtab.find(want, at + 1)
        hits = np.flatnonzero(np.isin(self._name_at, np.array(keys, dtype=np.int64))) if keys else []
        return int(self.value[hits[0]]) if len(hits) else None

    def _name(self, i: int) -> str:
        at = int(self._name_at[i])
        return _cstring(self._strtabs[at >> 40], at & ((1 << 40) - 1)).decode(errors="replace")

    def symbol(self, vaddr: int) -> tuple[str, int] | None:
        """(name, offset) of the object holding `vaddr`, an address as linked."""
        i = int(np.searchsorted(self.value, np.uint64(vaddr), side="right")) - 1
        if i >= 0 and vaddr < int(self.value[i]) + int(self.size[i]):
            return self._name(i), vaddr - int(self.value[i])
        return None

    def _plain_alias(self, i: int) -> str:
        """The name of symbol i, or of another at the same address without a symbol
        version ("glob" for "glob@@GLIBC_2.27")."""
        name = self._name(i)
        j = i
        while "@" in name and j > 0 and self.value[j - 1] == self.value[i]:
            j -= 1
            name = self._name(j) if "@" not in self._name(j) else name
        return name

    def function(self, vaddr: int) -> str | None:
        """The function holding `vaddr`, as bcc finds it: the nearest start at or below,
        stepping back over functions nested in a bigger one (a cold part inside its
        parent) but not past one that ends before the nearest's start."""
        i = int(np.searchsorted(self.value, np.uint64(vaddr), side="right")) - 1
        if i < 0:
            return None
        limit = int(self.value[i])
        while i >= 0 and vaddr >= int(self.value[i]):
            end = int(self.value[i]) + int(self.size[i])
            if vaddr < end:
                return self._plain_alias(i)
            if limit > end:
                break
            i -= 1
        return None


def futex_pairs(batch: pa.RecordBatch) -> np.ndarray:
    """The distinct (pid, addr) pairs of the futex rows in `batch`, as int64."""
    futex = pc.equal(batch.column(batch.schema.get_field_index("kind")), "futex")
    if not batch.num_rows or not pc.any(futex).as_py():
        return np.zeros((0, 2), np.int64)
    rows = batch.filter(futex)
    pid = rows.column(batch.schema.get_field_index("pid")).to_numpy(zero_copy_only=False).astype(np.int64)
    addr = rows.column(batch.schema.get_field_index("addr")).to_numpy(zero_copy_only=False).astype(np.uint64)
    return np.unique(np.stack([pid, addr.view(np.int64)], axis=1), axis=0)


def _cstring(data, start: int) -> bytes:
    if not 0 <= start < len(data):  # a malformed file's offset
        return b""
    end = data.find(b"\0", start)
    return data[start:end if end >= 0 else start]


class AddressDescriber:
    """Describes each new (pid, futex address) once, while the process is alive."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.done: set[tuple[int, int]] = set()
        self._images: dict[tuple[str, int], ElfSymbols | None] = {}  # (device, inode)
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
        elf = self._elf(pid, next(m for m in maps if m.path == path))
        if elf is None:
            return None
        base = min((m.start - m.offset for m in maps if m.path == path), default=0)
        vaddr = addr if elf.is_exec else addr - base + elf.first_vaddr
        if not elf.first_vaddr <= vaddr < elf.end_vaddr:
            return None
        short = os.path.basename(path)
        sym = elf.symbol(vaddr)
        if sym is None:
            return f"{short}+0x{vaddr:x}"
        name, off = sym
        return f"{name}+0x{off:x} [{short}]"

    def _elf(self, pid: int, m: Mapping) -> ElfSymbols | None:
        """The symbols of the file mapped at `m` (open_mapped: the very file, also in a
        container), None where it cannot be read or is malformed."""
        if m.file not in self._images:
            if len(self._images) >= MAX_IMAGES:
                self._images.clear()
            try:
                fd = open_mapped(pid, m, self.proc)
            except OSError:
                return None  # not kept: a later flush may open it
            try:
                self._images[m.file] = ElfSymbols(f"/proc/self/fd/{fd}")
            except (OSError, ValueError):
                self._images[m.file] = None
            finally:
                os.close(fd)
        return self._images[m.file]
