"""Under sudo, which processes may be traced: those the invoking user could ptrace
(docs/security.md, "Whose processes are traced").

The kernel lets a user ptrace a process whose real, effective and saved uids are all the
user's, likewise its gids, which holds no capability the user lacks (capabilities inside
a user namespace the user created do not count), and which is dumpable.  A process is
not dumpable after it exec'd a setuid or setgid program, and the kernel then hands its
/proc/PID directory to root: so the directory's owner tells, without a ptrace attach,
what ptrace would decide.

A process admitted may exec such a program later: under sudo the probes take every
process that execs out of the traced set at the exec (probes/sched.bpf.c, EXEC_LEAVES),
before its new program runs, and Gate.after_execs lets it back in only if it passes
again.  Rows of a process that left are dropped before they are written from the start
of its exec on (the rename an exec makes before its new credentials apply:
Gate.drop_left), so whatever was still on its way (a futex wait whose entry the next
flush removes) never reaches the trace."""

from __future__ import annotations

import fcntl
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.trace.asuser import Invoker
from trainbpf.trace.errors import TargetError, UsageError
from trainbpf.trace.spool import make_batch
from trainbpf.tracer import loader
from trainbpf.tracer.collector import ThreadTable
from trainbpf.tracer.proctree import ThreadInfo


NS_GET_OWNER_UID = 0xB704  # ioctl on a user namespace: the uid that created it


def _in_namespace_of(pid: int, uid: int) -> bool:
    """Whether process `pid` lives in a user namespace `uid` created (a rootless
    container's): its capabilities reach only inside, where that user holds every one."""
    try:
        if os.stat(f"/proc/{pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino:
            return False
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        try:
            owner = bytearray(4)
            fcntl.ioctl(fd, NS_GET_OWNER_UID, owner, True)
        finally:
            os.close(fd)
    except OSError:
        return False
    return int.from_bytes(owner, sys.byteorder) == uid


def refusal(pid: int, who: Invoker) -> str | None:
    """Why `who` could not ptrace process `pid` (a few words), None when they could."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            status = fh.read().decode(errors="replace")
        owner = os.stat(f"/proc/{pid}")
    except OSError:
        return "it is gone"
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        uids = [int(v) for v in fields["Uid"].split()]
        gids = [int(v) for v in fields["Gid"].split()]
        caps = int(fields["CapPrm"], 16)
    except (KeyError, ValueError):
        return "its status is unreadable"
    if any(u != who.uid for u in uids):
        return f"it runs as uid {'/'.join(map(str, uids))}, not {who.uid}"
    if any(g != who.gid for g in gids):
        return f"it runs as gid {'/'.join(map(str, gids))}, not {who.gid}"
    if caps and not _in_namespace_of(pid, who.uid):
        return "it holds capabilities"
    if (owner.st_uid, owner.st_gid) != (who.uid, who.gid):  # root's: not dumpable
        return "it is not dumpable (it exec'd a setuid or setgid program, or made itself so)"
    return None


def _sentence(pid: int, why: str, who: Invoker) -> str:
    return f"process {pid}: {why}; under sudo only processes uid {who.uid} could ptrace are traced"


def proc_hides_processes(mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether /proc is mounted with hidepid (a user sees only their own processes)."""
    try:
        with open(mountinfo, "rb") as fh:
            lines = fh.read(1 << 20).decode("utf-8", "replace").splitlines()
    except OSError:
        return True  # unknown: assume the stricter
    for line in lines:
        fields = line.split(" - ", 1)
        head = fields[0].split()
        if len(fields) == 2 and len(head) > 4 and head[4] == "/proc" and fields[1].startswith("proc "):
            options = fields[1].split()[-1].split(",")
            return any(o.startswith("hidepid=") and o[8:] not in ("0", "off") for o in options)
    return False


def owner_of(pid: int) -> int:
    """The uid owning /proc/PID (-1 when gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


@dataclass
class Gate:
    """The sudo user's processes in, everyone else's out, for one recording."""

    who: Invoker
    notice: Callable[[str], None] | None = None
    left: dict[int, int] = field(default_factory=dict)  # pid -> ts_ns from which its rows are dropped
    notes: list[dict] = field(default_factory=list)  # the trace's `untraced` metadata
    execs_read: int = 0  # ThreadTable.exec_log entries already seen
    hidden_proc: bool | None = None  # /proc mounted with hidepid (proc_hides_processes), once known

    def check_target(self, pid: int | None) -> None:
        if pid is None:
            raise UsageError("--system-wide traces every user's processes: run it as root, not through sudo")
        why = refusal(pid, self.who)
        if why is not None:
            raise TargetError(_sentence(pid, why, self.who))

    def sees(self, pid: int) -> bool:
        """Whether the sudo user could see process `pid` in /proc themselves: any process,
        unless /proc hides other users' (hidepid); then only their own.  What they could
        not see is kept out of the trace (a task that preempted a traced thread)."""
        if self.hidden_proc is None:
            self.hidden_proc = proc_hides_processes()
        return not self.hidden_proc or owner_of(pid) == self.who.uid

    def admits(self, pid: int) -> bool:
        """Whether process `pid` may be traced now: it has not left, and passes again."""
        return pid not in self.left and refusal(pid, self.who) is None

    def admit(self, threads: list[ThreadInfo], now_ns: int) -> list[ThreadInfo]:
        """The threads of processes that may be traced; each other process is noted once."""
        verdict = {pid: refusal(pid, self.who) for pid in {t.pid for t in threads} - set(self.left)}
        for pid, why in verdict.items():
            if why is not None:
                self._leave(pid, [t.tid for t in threads if t.pid == pid], now_ns, why, "seen")
        return [t for t in threads if verdict.get(t.pid, "left") is None]

    def confirm(self, bpf, threads: list[ThreadInfo], table: ThreadTable, checked_ns: int) -> list[ThreadInfo]:
        """After their threads joined the traced set: an exec between the check and the join
        escaped the probes, so each process is checked again; one that fails leaves with
        its rows from the first check on."""
        out = []
        for pid in sorted({t.pid for t in threads}):
            mine = [t for t in threads if t.pid == pid]
            why = refusal(pid, self.who)
            if why is None:
                out += mine
                continue
            loader.untrace(bpf, [t.tid for t in mine])
            table.untraced.add(pid)
            for t in mine:
                table.exit(t.tid)  # out of every probe's maps at the next flush
            self._leave(pid, [t.tid for t in mine], checked_ns, why, "seen")
        return out

    def after_execs(self, bpf, table: ThreadTable) -> tuple[list[int], pa.RecordBatch | None]:
        """The processes that exec'd since the last call, which the probes took out of the
        traced set: (pids let back in, whose trees the recorder walks again; `exit` rows
        ending the threads of those kept out)."""
        execs, self.execs_read = table.exec_log[self.execs_read:], len(table.exec_log)
        back, gone = [], []
        for tid, pid, ts_ns, comm in execs:
            if pid in self.left:
                continue
            why = refusal(pid, self.who)
            if why is None:
                loader.set_traced(bpf, tid, pid)
                back.append(pid)
                continue
            table.exit(tid)
            table.untraced.add(pid)
            self._leave(pid, [tid], ts_ns, why, f"exec of {comm}")
            gone.append((ts_ns, tid, pid, comm))
        if not gone:
            return back, None
        ts, tid, pid, comm = zip(*gone)
        return back, make_batch("exit", {"ts_ns": np.array(ts, dtype=np.int64), "tid": np.array(tid, dtype=np.int32),
                                         "pid": np.array(pid, dtype=np.int32), "comm": list(comm)})

    def drop_left(self, rows: pa.RecordBatch) -> pa.RecordBatch:
        """`rows` without those of processes that left, from the moment each left."""
        if not self.left or not rows.num_rows:
            return rows
        which = pc.index_in(pc.cast(rows.column("pid"), pa.int64()), value_set=pa.array(list(self.left), pa.int64()))
        since = pc.take(pa.array(list(self.left.values()), pa.int64()), which)  # null: not a process that left
        drop = pc.fill_null(pc.greater_equal(rows.column("ts_ns"), since), False)
        return rows.filter(pc.invert(drop)) if pc.any(drop).as_py() else rows

    def meta(self) -> dict:
        return {"untraced": self.notes}

    def _leave(self, pid: int, tids: list[int], ts_ns: int, why: str, when: str) -> None:
        self.left[pid] = ts_ns
        self.notes.append({"pid": pid, "tids": sorted(tids), "ts_ns": ts_ns, "when": when, "why": why})
        if self.notice:
            self.notice(f"not traced: {_sentence(pid, why, self.who)}" + (f" ({when})" if when != "seen" else ""))
