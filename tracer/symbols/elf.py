"""Reading ELF files the traced processes map: symbol tables (data objects, functions),
program headers and the build id, bounds-checked, since the processes choose the files."""

from __future__ import annotations

import mmap
import os
import re
import zlib

import numpy as np

from trainbpf.tracer.symbols import debuginfod

_ELF64_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                       ("value", "<u8"), ("size", "<u8")])
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_SHT_NOTE, _SHT_NOBITS = 7, 8
_STT_OBJECT, _STT_FUNC, _STT_TLS, _STT_GNU_IFUNC = 1, 2, 6, 10
OBJECT_KINDS = (_STT_OBJECT, _STT_TLS)
FUNCTION_KINDS = (_STT_FUNC, _STT_GNU_IFUNC)  # what bcc names code with
DEBUG_ROOT = "/usr/lib/debug"
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
        self.debuglink_crc: int | None = None  # the debug file's CRC32, as .gnu_debuglink gives it
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
                name = _cstring(data, off)
                self.debuglink = name.decode(errors="replace")
                at = off + ((len(name) + 4) & ~3)  # the name, its NUL, padded to 4 bytes, then the CRC
                if at + 4 <= min(off + size, len(data)):
                    self.debuglink_crc = int.from_bytes(data[at:at + 4], "little")

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



def _cstring(data, start: int) -> bytes:
    if not 0 <= start < len(data):  # a malformed file's offset
        return b""
    end = data.find(b"\0", start)
    return data[start:end if end >= 0 else start]


def debug_file(path: str, elf: ElfSymbols, *, fetch: bool = False) -> str | None:
    """Where a stripped file's debug symbols are, as bcc looks: by build-id, then by
    debuglink beside the file, in .debug/ there, and under /usr/lib/debug, a file found
    by its debuglink name only where its CRC32 is the one the link gives (a container's
    library named the same as a host debug file of another build is not named from it);
    else, with `fetch` and where the user names debuginfod servers, fetched by build-id
    (tracer/symbols/debuginfod.py)."""
    local = None
    if elf.build_id:
        by_id = f"{DEBUG_ROOT}/.build-id/{elf.build_id[:2]}/{elf.build_id[2:]}.debug"
        local = by_id if by_id != path and os.path.isfile(by_id) else None
    if local is None and elf.debuglink and elf.debuglink_crc is not None:
        folder = os.path.dirname(path)
        linked = (f"{folder}/{elf.debuglink}", f"{folder}/.debug/{elf.debuglink}",
                  f"{DEBUG_ROOT}{folder}/{elf.debuglink}")
        local = next((c for c in linked if c != path and os.path.isfile(c) and _crc32(c) == elf.debuglink_crc), None)
    if local or not fetch or not elf.build_id:
        return local
    return debuginfod.cached(elf.build_id) or _fetched(elf.build_id)


def _crc32(path: str) -> int | None:
    """The CRC32 of a whole file (gdb's and bcc's debuglink check), None when unreadable."""
    crc = 0
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
    except OSError:
        return None
    return crc


def _fetched(build_id: str) -> str | None:
    """The debug file a debuginfod server sent for `build_id`, kept when its own build-id
    note says it is that file's."""
    got = debuginfod.download(build_id)
    if got is None:
        return None
    try:
        same = ElfSymbols(got, ()).build_id == build_id
    except (OSError, ValueError):  # not ELF, malformed, empty
        same = False
    if not same:
        debuginfod.discard(got, build_id)
        return None
    return debuginfod.keep(got, build_id)


def symbol_tables(opened: str, path: str, kinds: tuple[int, ...], *, every_table: bool = False,
                  fetch: bool = False) -> list[ElfSymbols]:
    """The symbols of the file `path` (read from `opened`, e.g. /proc/self/fd/N): its
    separate debug file's first, where one is installed (a distribution's libraries are
    stripped: glibc's main_arena is named only there) or, with `fetch`, a debuginfod
    server has it, the file's own last; none when the file cannot be read or is malformed."""
    try:
        own = ElfSymbols(opened, kinds, every_table=every_table)
    except (OSError, ValueError):
        return []
    debug = debug_file(path, own, fetch=fetch)
    if debug:
        try:
            return [ElfSymbols(debug, kinds, every_table=every_table), own]
        except (OSError, ValueError):
            pass
    return [own]
