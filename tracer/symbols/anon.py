"""Naming code that lies in no file: a JIT's, from its perf map (/tmp/perf-PID.map, as
perf and bcc read it), and the vdso, the kernel's one image in every process, named from
this process's copy.

bcc's per-process lookup (BPF.sym with a pid) is not used: Debian's bcc 0.26 closes a
descriptor number it never opened each time it reads a process's modules (an
uninitialised ModulePath::fd_, fixed in bcc 0.33), and the number was at times one of
the recorder's BPF maps or programs (docs/design.md, "Recorder")."""

from __future__ import annotations

import bisect
import ctypes
import os
import stat

from trainbpf.tracer.symbols.elf import FUNCTION_KINDS, ElfSymbols
from trainbpf.tracer.symbols.maps import Mapping, parse_maps

MAX_PERF_MAP_BYTES = 16 << 20  # a JIT's map of a few hundred thousand symbols
MAX_PERF_MAPS = 64  # processes whose maps are kept


class PerfMap:
    """One process's perf map: `start size name` per line, addresses in hex."""

    def __init__(self, text: str):
        rows = []
        for line in text.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) != 3:
                continue
            try:
                rows.append((int(parts[0], 16), int(parts[1], 16), parts[2]))
            except ValueError:
                continue
        rows.sort()
        self._starts = [r[0] for r in rows]
        self._rows = rows

    def name(self, addr: int) -> str | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start, size, name = self._rows[i]
        return name if addr < start + size else None


def read_perf_map(path: str, owner: int) -> PerfMap | None:
    """The perf map at `path` if it is a regular file of the process's owner (or root)
    and not too large: anyone may write /tmp, and the recorder runs as root."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (owner, 0) or st.st_size > MAX_PERF_MAP_BYTES:
            return None
        return PerfMap(os.read(fd, MAX_PERF_MAP_BYTES).decode(errors="replace"))
    except OSError:
        return None
    finally:
        os.close(fd)


def _ns_pid(status: str, pid: int) -> int:
    """The process's pid in its own namespace (NSpid's last field): a container's JIT
    names its map by that pid."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            return int(fields[-1]) if fields else pid
    return pid


class AnonymousCode:
    """Names for addresses outside files: "function [perf-PID.map]" from a JIT's perf
    map, "function [[vdso]]" in the vdso (as bcc wrote both), else None."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self._perf_maps: dict[int, PerfMap | None] = {}
        self._vdso: tuple[ElfSymbols | None] | None = None

    def name(self, addr: int, pid: int, m: Mapping | None) -> str | None:
        if m is not None and m.path == "[vdso]":
            function = self._vdso_function(addr - m.start)
            return f"{function} [[vdso]]" if function else None
        perf_map = self._perf_map(pid)
        function = perf_map.name(addr) if perf_map else None
        return f"{function} [perf-{pid}.map]" if function else None

    def _perf_map(self, pid: int) -> PerfMap | None:
        if pid not in self._perf_maps:
            if len(self._perf_maps) >= MAX_PERF_MAPS:
                self._perf_maps.clear()
            self._perf_maps[pid] = self._read_perf_map(pid)
        return self._perf_maps[pid]

    def _read_perf_map(self, pid: int) -> PerfMap | None:
        try:
            with open(f"{self.proc}/{pid}/status") as fh:
                status = fh.read()
            owner = os.stat(f"{self.proc}/{pid}").st_uid
        except OSError:
            return None
        inner = _ns_pid(status, pid)
        for path in (f"{self.proc}/{pid}/root/tmp/perf-{inner}.map", f"/tmp/perf-{pid}.map"):
            found = read_perf_map(path, owner)
            if found is not None:
                return found
        return None

    def _vdso_function(self, offset: int) -> str | None:
        if self._vdso is None:
            self._vdso = (_own_vdso(),)
        elf = self._vdso[0]
        if elf is None:
            return None
        vaddr = elf.file_vaddr(offset)
        return elf.function(vaddr) if vaddr is not None else None


def _own_vdso() -> ElfSymbols | None:
    """This process's vdso, copied to a memory file and read as any ELF file."""
    try:
        with open("/proc/self/maps") as fh:
            vdso = next((m for m in parse_maps(fh.read()) if m.path == "[vdso]"), None)
    except OSError:
        return None
    if vdso is None:
        return None
    fd = os.memfd_create("vdso", os.MFD_CLOEXEC)
    try:
        os.write(fd, ctypes.string_at(vdso.start, vdso.end - vdso.start))
        return ElfSymbols(f"/proc/self/fd/{fd}", FUNCTION_KINDS)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
