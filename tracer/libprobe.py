"""Uprobes on shared libraries the traced processes map (the cuda and nccl probes).

Libraries are found in /proc/PID/maps (pip wheels put them under
site-packages/nvidia/*/lib), rescanned at every flush: torch loads CUDA and NCCL lazily.
Each is probed through the file mapped itself (addrs.open_mapped: /proc/PID/map_files),
never by the name the process saw, which its owner may have pointed at another file
since (docs/security.md); a container's copy is so the one probed too.  A uprobe on a
file fires in every process mapping it, forked workers included, so each library file
(device, inode) is attached once."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import ClassVar

from trainbpf.tracer.collector import Collector, ThreadTable
from trainbpf.tracer.symbols.elf import FUNCTION_KINDS, ElfSymbols
from trainbpf.tracer.symbols.maps import Mapping, open_mapped, parse_maps


@dataclass(frozen=True)
class LibraryCalls:
    """Which mapped libraries a probe attaches to, and which of their symbols."""

    path_re: re.Pattern  # the library file's path
    marker: str  # in every such path: maps without it need no parsing
    symbol_re: str  # a probed symbol; group 1 is its base name, the call's

    def mappings(self, maps_text: str) -> list[Mapping]:
        """The first mapping of each library file (device, inode) mapped."""
        seen: dict[tuple[str, int], Mapping] = {}
        for m in parse_maps(maps_text):
            if self.path_re.search(m.path):
                seen.setdefault(m.file, m)
        return list(seen.values())

    def base_name(self, symbol: str) -> str | None:
        m = re.match(self.symbol_re, symbol)
        return m.group(1) if m else None

    def exported(self, path: str) -> list[tuple[str, str]]:
        """(symbol, base name) of the probed calls a library exports, one per address: an
        alias at the address of another symbol would count every call twice.  The
        symbols are read as bcc reads them (both tables); a malformed file raises
        ValueError."""
        by_addr: dict[int, str] = {}
        for sym, addr in ElfSymbols(path, FUNCTION_KINDS, every_table=True).named(self.symbol_re):
            if addr not in by_addr or len(sym) < len(by_addr[addr]):  # the base name wins
                by_addr[addr] = sym
        return sorted((sym, self.base_name(sym)) for sym in by_addr.values())


def _code_size(pid: int) -> bytes:
    """The size of a process's executable mappings outside its program (the VmLib line
    of /proc/PID/status): it grows when a library is mapped, and, unlike the total size
    of its mappings, stays put while the process maps and unmaps memory, as a trainer's
    allocator does tens of thousands of times a second."""
    fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    try:
        text = os.read(fd, 4096)
    finally:
        os.close(fd)
    start = text.find(b"\nVmLib:")
    return text[start:text.find(b"\n", start + 1)] if start >= 0 else b""  # a kernel thread maps nothing


class LibraryCollector(Collector):
    """A probe of calls into mapped libraries: finds them in the traced processes' maps
    at the start and at every flush (drain calls scan), attaches each file once, and
    lists them in the metadata under the probe's name."""

    uprobes = True
    calls: ClassVar[LibraryCalls]

    def __init__(self, settings):
        super().__init__(settings)
        self.libraries: dict[tuple[str, int], dict] = {}  # (device, inode) -> metadata
        self._size_seen: dict[int, bytes] = {}  # pid -> the size of its code mapped when last scanned
        self._pids: set[int] = set()
        self._held: list[int] = []  # descriptors of the files probed, whose /proc/self/fd names the probes hold
        self.threads = ThreadTable()  # the recorder's, from seeded()

    def attach_call(self, bpf, opened: str, sym: str, base: str) -> None:
        """Attach the probe's programs for `sym` (call `base`) in the file `opened`;
        bcc's bare Exception on failure."""
        raise NotImplementedError

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list:
        if not final:
            self.scan(bpf)
        return []

    def seeded(self, bpf, walked, threads, now_ns: int) -> None:
        self.threads = threads
        self.scan(bpf)

    def scan(self, bpf) -> None:
        """Attach to libraries newly mapped by traced processes."""
        # The recorder's table, which learns of new processes at each flush.
        self._pids.update(self.threads.live().values())
        for pid in sorted(self._pids):
            try:
                # A library mapped since changes the size of the code mapped, and reading
                # it costs ~20 us where the maps cost ~0.5 ms a process (docs/performance.md).
                # Unless other code was unmapped, exactly as much, meanwhile: then the
                # library is found at the next change of size.
                size = _code_size(pid)
                if self._size_seen.get(pid) == size:
                    continue
                with open(f"/proc/{pid}/maps") as fh:
                    text = fh.read()
            except OSError:
                self._pids.discard(pid)
                self._size_seen.pop(pid, None)
                continue
            self._size_seen[pid] = size
            if self.calls.marker not in text:  # most processes: no need to parse
                continue
            for m in self.calls.mappings(text):
                if m.file not in self.libraries:
                    self._attach(bpf, pid, m)
                lib = self.libraries[m.file]
                if pid not in lib["pids"]:
                    lib["pids"].append(pid)

    def _attach(self, bpf, pid: int, m: Mapping) -> None:
        """Probe the file `m` maps, through a descriptor of it: the kernel resolves
        /proc/self/fd/N to that very inode, and no one can repoint the name."""
        probed, failed, why = [], [], ""
        try:
            fd = open_mapped(pid, m)
        except OSError as exc:
            calls, why = [], f"not opened: {exc.strerror or exc}"
        else:
            self._held.append(fd)
            opened = f"/proc/self/fd/{fd}"
            try:
                calls = self.calls.exported(opened)
            except (OSError, ValueError) as exc:  # unreadable, or a malformed ELF file
                calls, why = [], f"not read: {exc}"
        for sym, base in calls:
            try:
                self.attach_call(bpf, opened, sym, base)
                probed.append(sym)
            except Exception:  # bcc raises bare Exception
                failed.append(sym)
        self.libraries[m.file] = {"path": m.path, "device": m.file[0], "inode": m.file[1], "symbols": probed,
                                  "failed": failed, "pids": [], **({"error": why} if why else {})}
        if self.notice:
            self.notice(f"{self.name}: probing {len(probed)} symbols in {m.path} (process {pid})"
                        + (f", {len(failed)} failed" if failed else "") + (f"; {why}" if why else ""))

    def close(self) -> None:
        for fd in self._held:
            os.close(fd)
        self._held.clear()

    def meta(self) -> dict:
        return {self.name: {"libraries": list(self.libraries.values())}}
