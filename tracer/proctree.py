"""The traced process tree as /proc shows it: the target, its threads and descendants."""

from __future__ import annotations

import os
import select
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# Enough of /proc/TID/status for its Tgid line: Name (up to 64 bytes escaped), Umask, State.
STATUS_HEAD_BYTES = 512


@dataclass(frozen=True)
class ThreadInfo:
    tid: int
    pid: int  # tgid
    comm: str
    parent_tid: int  # the process's parent for main threads, else the tgid
    state: str = "R"  # /proc state letter when seen: R running, S sleeping, D disk wait, ...


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")  # a name or argv need not be UTF-8
    except OSError:
        return None


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """(comm, fields after comm) of a /proc stat line; comm may hold spaces and ')'."""
    start, end = text.index("("), text.rindex(")")
    return text[start + 1 : end], text[end + 2 :].split()


def process_state(pid: int, tid: int | None = None) -> str | None:
    """One-letter state of a process (or of its thread `tid`), None when it is gone.
    Plain bytes, no pathlib: the recorder asks ten times a second."""
    try:
        with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
            text = fh.read()
    except OSError:
        return None
    end = text.rfind(b")")
    return chr(text[end + 2]) if 0 <= end < len(text) - 2 else None


def tgid_of(tid: int) -> int:
    """The process (tgid) thread `tid` belongs to, any process's, from the head of
    /proc/TID/status (Tgid is its fourth line); -1 when the thread is gone."""
    try:  # a descriptor, not a file object: this runs for every new peer at every flush
        fd = os.open(f"/proc/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        head = os.read(fd, STATUS_HEAD_BYTES)
    except OSError:
        return -1
    finally:
        os.close(fd)
    at = head.find(b"\nTgid:")
    end = head.find(b"\n", at + 1)
    try:
        return int(head[at + 6:end]) if at >= 0 and end > at else -1
    except ValueError:
        return -1


def is_alive(pid: int) -> bool:
    """Whether any thread of process `pid` still runs.  A main thread that called
    pthread_exit stays a zombie (state Z) while the other threads work on."""
    state = process_state(pid)
    if state != "Z":
        return state not in (None, "X")
    try:
        tids = [int(t) for t in os.listdir(PROC / str(pid) / "task") if t != str(pid)]
    except OSError:
        return False
    return any(process_state(pid, tid) not in (None, "Z", "X") for tid in tids)


class Liveness:
    """Whether process `pid` still runs, asked at every wake-up of the recorder.  A pidfd
    (`fd`, which the recorder also waits on) turns readable once its last thread has
    exited (a main thread that called pthread_exit does not count), which costs one
    select() instead of reading /proc (~50-90 µs a time in the recorder); without
    pidfd_open, /proc as is_alive reads it."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or a kernel before 5.3
            self.fd = None

    def alive(self) -> bool:
        if self.fd is None:
            return is_alive(self.pid)
        return not select.select([self.fd], [], [], 0)[0]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _children() -> dict[int, list[int]]:
    """ppid -> child pids, for every process on the machine."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        text = _read(PROC / entry.name / "stat")
        if text is None:
            continue
        ppid = int(_stat_fields(text)[1][1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendant processes (tgids)."""
    kids = _children()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in tree:
            continue
        tree.append(p)
        todo.extend(kids.get(p, []))
    return tree


def threads_of(pid: int) -> list[ThreadInfo]:
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(PROC / str(pid) / "task"))
    except OSError:
        return out
    ppid = None
    for tid in tids:
        text = _read(PROC / str(pid) / "task" / str(tid) / "stat")
        if text is None:
            continue
        comm, fields = _stat_fields(text)
        if tid == pid:
            ppid = int(fields[1])
        out.append(ThreadInfo(tid, pid, comm, ppid if tid == pid and ppid is not None else pid, fields[0]))
    return out


def tree_threads(pid: int, *, exclude: int | None = None) -> list[ThreadInfo]:
    """Every thread of `pid` and of its descendants, but none of process `exclude` and
    its descendants (the recorder itself, when it runs below `pid`) outside `pid`'s own
    subtree."""
    skip = set(process_tree(exclude)) if exclude is not None else set()
    if pid in skip:  # a target the recorder started: only what is not below the target
        skip -= set(process_tree(pid))
    return [t for p in process_tree(pid) if p not in skip for t in threads_of(p)]


def all_threads() -> list[ThreadInfo]:
    """Every thread on the machine (the node-wide recording's thread table)."""
    return [t for e in os.scandir(PROC) if e.name.isdigit() for t in threads_of(int(e.name))]


def cmdline(pid: int) -> list[str]:
    raw = _read(PROC / str(pid) / "cmdline") or ""
    return [a for a in raw.split("\0") if a]


def processes() -> dict[int, ThreadInfo]:
    """The main thread of every process on the machine (its parent in `parent_tid`),
    one /proc/PID/stat read each."""
    out = {}
    for entry in os.scandir(PROC):
        text = _read(PROC / entry.name / "stat") if entry.name.isdigit() else None
        if text is not None and ")" in text:
            comm, fields = _stat_fields(text)
            pid = int(entry.name)
            out[pid] = ThreadInfo(pid, pid, comm, int(fields[1]), fields[0])
    return out


def holds_open(pid: int, paths: set[str]) -> bool:
    """Whether process `pid` has a file open whose resolved path is in `paths`."""
    fd_dir = PROC / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd_dir / fd) in paths:
                return True
        except OSError:
            continue
    return False
