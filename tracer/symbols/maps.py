"""A process's memory mappings from /proc/PID/maps, which one holds an address, and
the very file a mapping maps."""

from __future__ import annotations

import bisect
import errno
import os
from dataclasses import dataclass


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
            return open_if_mapped(path, m)
        except OSError as exc:
            err = exc
    raise err


def open_if_mapped(path: str, m: Mapping) -> int:
    """A read-only descriptor of `path` if it is the file mapped at `m` (its device and
    inode); OSError otherwise.  By its name a mapping's file may be another: replaced
    since, or a container's, whose path on the host leads elsewhere."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    st = os.fstat(fd)
    major, minor = (int(x, 16) for x in m.file[0].split(":"))
    if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == (major, minor, m.file[1]):
        return fd
    os.close(fd)
    raise OSError(errno.ESTALE, f"{m.path} is no longer the file mapped")


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
