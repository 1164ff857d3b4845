"""The traced processes' memory cgroups (`memory_cgroup` rows): each process's cgroup
found from /proc/PID/cgroup and the hierarchy's mount in /proc/self/mountinfo, cgroup v1
(a `memory` hierarchy) or v2 (a cgroup2 mount whose root enables `memory`); its limit,
usage and memory.stat read a few files at a time, each cgroup once per sample however
many traced processes are in it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch

# memory.stat keys as the trace names them: v2's own names; v1's hierarchical totals
# (usage_in_bytes counts the cgroup's children too, as v2's memory.current does).
STAT_KEYS = {
    2: {"file": "file", "anon": "anon", "file_dirty": "file_dirty", "file_writeback": "file_writeback",
        "workingset_refault_file": "workingset_refault_file"},
    1: {"total_cache": "file", "total_rss": "anon", "total_dirty": "file_dirty",
        "total_writeback": "file_writeback", "total_workingset_refault_file": "workingset_refault_file"},
}
# (key, file) of the single-value files; "max" (unlimited) means no row
VALUE_FILES = {
    2: (("max", "memory.max"), ("high", "memory.high"), ("usage", "memory.current")),
    1: (("max", "memory.limit_in_bytes"), ("usage", "memory.usage_in_bytes")),
}
# v1 says "unlimited" with the page counter's largest value (PAGE_COUNTER_MAX pages).
V1_UNLIMITED = 1 << 62
READ_BYTES = 1 << 16


@dataclass(frozen=True)
class Hierarchy:
    """Where a memory cgroup hierarchy is mounted: `root` is the cgroup path the mount
    shows at `mountpoint` ("/" unless a namespace or bind mount shows a subtree)."""

    version: int
    root: str
    mountpoint: Path


@dataclass(frozen=True)
class MemoryCgroup:
    version: int
    path: str  # below the hierarchy's root, as /proc/PID/cgroup says it: "/train.slice/job-1"
    folder: Path  # its folder in the mounted file system


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (\\040 for a space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def hierarchies(mountinfo: str) -> dict[int, Hierarchy]:
    """The memory hierarchies of a mountinfo text, by version: v1's `cgroup` mount with the
    `memory` option, v2's `cgroup2` mount whose root lists `memory` in cgroup.controllers."""
    found: dict[int, Hierarchy] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        root, mountpoint = _unescape(fields[3]), Path(_unescape(fields[4]))
        fstype, options = fields[sep + 1], fields[sep + 3].split(",") if len(fields) > sep + 3 else []
        if fstype == "cgroup" and "memory" in options and 1 not in found:
            found[1] = Hierarchy(1, root, mountpoint)
        elif fstype == "cgroup2" and 2 not in found and "memory" in _read(mountpoint / "cgroup.controllers").split():
            found[2] = Hierarchy(2, root, mountpoint)
    return found


def locate(cgroup_file: str, found: dict[int, Hierarchy]) -> MemoryCgroup | None:
    """A process's memory cgroup from its /proc/PID/cgroup text: v1's `memory` line
    before v2's `0::` line; None when neither names a mounted hierarchy, or its cgroup
    lies outside what the mount shows."""
    entries = [line.split(":", 2) for line in cgroup_file.splitlines() if line.count(":") >= 2]
    paths = {1: next((path for _, controllers, path in entries if "memory" in controllers.split(",")), None),
             2: next((path for hid, controllers, path in entries if hid == "0" and controllers == ""), None)}
    for version, path in paths.items():
        hierarchy = found.get(version)
        if hierarchy is None or path is None:
            continue
        below = os.path.relpath(path, hierarchy.root)
        if below == ".." or below.startswith("../"):
            return None
        return MemoryCgroup(version, path, hierarchy.mountpoint if below == "." else hierarchy.mountpoint / below)
    return None


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(READ_BYTES).decode(errors="replace")
    except OSError:
        return ""


class HeldFiles:
    """Files read again and again (each cgroup's memory files, every 500 ms): held open
    and re-read from offset 0, which generates them afresh; an open, read and close each
    time cost twice as much.  A file that cannot be read through its descriptor (its
    cgroup removed) is opened by path again; past MAX_HELD, files are read by path only."""

    MAX_HELD = 256

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def read(self, path: Path) -> str:
        fd = self.fds.get(path)
        if fd is not None:
            try:
                text = os.pread(fd, READ_BYTES, 0)
                if text:
                    return text.decode(errors="replace")
            except OSError:
                pass
            os.close(self.fds.pop(path))  # removed: the path says what is there now
        if len(self.fds) >= self.MAX_HELD:
            return _read(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return ""
        self.fds[path] = fd
        try:
            return os.pread(fd, READ_BYTES, 0).decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def read_values(cgroup: MemoryCgroup, read: Callable[[Path], str] = _read) -> dict[str, int]:
    """The keys of a memory cgroup's files now: its version, limits (none when
    unlimited), usage and memory.stat's keys that name what fills it."""
    values = {"version": cgroup.version}
    for key, name in VALUE_FILES[cgroup.version]:
        text = read(cgroup.folder / name).strip()
        if text.isdigit() and not (cgroup.version == 1 and key == "max" and int(text) >= V1_UNLIMITED):
            values[key] = int(text)
    names = STAT_KEYS[cgroup.version]
    for line in read(cgroup.folder / "memory.stat").splitlines():
        key, _, value = line.partition(" ")
        if key in names and value.strip().isdigit():
            values[names[key]] = int(value)
    return values


class CgroupSampler:
    """The memory cgroups of the traced processes, read on demand: `take` reads each
    process's /proc/PID/cgroup (a process may move) and each cgroup's files once."""

    def __init__(self, *, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self.found = hierarchies(_read(proc / "self" / "mountinfo"))
        self.known: dict[MemoryCgroup, int] = {}  # every cgroup seen -> the process seen in it first
        self.files = HeldFiles()

    def cgroups(self, pids: list[int]) -> dict[MemoryCgroup, int]:
        """Each memory cgroup of `pids` -> the first of them in it."""
        seen: dict[MemoryCgroup, int] = {}
        if not self.found:
            return seen
        for pid in sorted(pids):
            cgroup = locate(_read(self.proc / str(pid) / "cgroup"), self.found)
            if cgroup is not None:
                seen.setdefault(cgroup, pid)
        return seen

    def rows(self, now_ns: int, pids: list[int], *, final: bool = False) -> list[tuple[int, int, str, str, int]]:
        """(ts_ns, pid, cgroup, key, value) of the cgroups `pids` are in now; `final`:
        also of those seen earlier that still exist, whose processes may have exited by
        the stop."""
        now = self.cgroups(pids)
        for cgroup, pid in now.items():
            self.known.setdefault(cgroup, pid)
        if final:
            now = {**{c: p for c, p in self.known.items() if c.folder.is_dir()}, **now}
        return [(now_ns, pid, cgroup.path, k, v) for cgroup, pid in now.items()
                for k, v in read_values(cgroup, self.files.read).items()]

    def take(self, now_ns: int, pids: list[int], *, final: bool = False) -> pa.RecordBatch | None:
        """rows() as `memory_cgroup` rows."""
        return cgroup_batch(self.rows(now_ns, pids, final=final))

    def close(self) -> None:
        self.files.close()


def cgroup_batch(rows: list[tuple[int, int, str, str, int]]) -> pa.RecordBatch | None:
    """`memory_cgroup` rows of CgroupSampler.rows(), of one sample or several."""
    if not rows:
        return None
    ts, pid, name, key, value = zip(*rows)
    return make_batch("memory_cgroup", {"ts_ns": np.array(ts, dtype=np.int64), "pid": np.array(pid, dtype=np.int32),
                                        "cgroup": list(name), "key": list(key), "value": np.array(value, dtype=np.int64)})
