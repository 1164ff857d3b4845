"""Whether a trace's analysis fits in memory, judged before a row is read: the rows its
Parquet footer counts, times what the analysis holds per row, against the memory this
process can still take.  A few MB of Parquet can hold tens of millions of rows (a
column repeating one value compresses to nothing); analysing them without the check
grows for minutes and ends in an allocation failure."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from trainbpf.trace.errors import TraceReadError
from trainbpf.trace.reader import Trace, read_trace

# Peak memory of `trainbpf analyze` per trace row, above the ~155 MiB the program takes
# for a small trace: measured on traces written as the recorder writes them
# (scripts/bench/gen_trace.py), 215 bytes a row at 2.0M rows, 201 at 6.0M, 156 at 10.0M
# (docs/performance-analysis.md).  The larger figures, for the check to refuse only
# what cannot fit.
ANALYSIS_BYTES_PER_ROW = 200
MEMINFO = Path("/proc/meminfo")
PROC_SELF = Path("/proc/self")
CGROUP_ROOT = Path("/sys/fs/cgroup")
GIB = 2**30


def read_for_analysis(path: str | os.PathLike, *, memory_check: bool = True) -> Trace:
    """read_trace, refusing (TraceReadError) a trace whose analysis would need more
    memory than is available, unless `memory_check` is off.  A Parquet trace is judged
    from its footer, before any row is read (a spool is read whole to be opened)."""
    trace = read_trace(path)
    if memory_check:
        need = trace.num_rows * ANALYSIS_BYTES_PER_ROW
        room = available_bytes()
        if room is not None and need > room:
            raise TraceReadError(
                f"{trace.path}: analysing its {trace.num_rows:,} rows needs about {need / GIB:.1f} GiB of memory "
                f"and {room / GIB:.1f} GiB is available; analyse it where more memory is free, or give "
                "--no-memory-check to try anyway")
    return trace


def available_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable, or less where a
    cgroup's limit or an rlimit (ulimit -v, -d) leaves less; None if nothing says."""
    rooms = [_mem_available(), _cgroup_room(), *_rlimit_rooms()]
    known = [r for r in rooms if r is not None]
    return max(0, min(known)) if known else None


def _kib_field(path: Path, name: str) -> int | None:
    """A "Name:  123 kB" line of /proc/meminfo or /proc/PID/status, in bytes."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mem_available() -> int | None:
    return _kib_field(MEMINFO, "MemAvailable")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max"
        return None


def _cgroup_room() -> int | None:
    """The room left under this process's memory cgroup and those above it (cgroup v2
    memory.max, v1 memory.limit_in_bytes)."""
    try:
        lines = (PROC_SELF / "cgroup").read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            folder, limit, usage = CGROUP_ROOT / where.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            folder, limit, usage = CGROUP_ROOT / "memory" / where.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for level in [folder, *folder.parents]:
            if level == CGROUP_ROOT.parent:
                break
            cap, used = _read_int(level / limit), _read_int(level / usage)
            if cap is not None and used is not None and cap < 2**60:  # v1 says "no limit" with a huge number
                rooms.append(cap - used)
    return min(rooms) if rooms else None


def _rlimit_rooms() -> list[int | None]:
    """What the address-space and data rlimits leave above this process's sizes now."""
    rooms: list[int | None] = []
    for limit, size in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft, _ = resource.getrlimit(limit)
        used = _kib_field(PROC_SELF / "status", size)
        rooms.append(None if soft == resource.RLIM_INFINITY or used is None else soft - used)
    return rooms
