"""Page faults per traced thread, from the kernel's own per-thread counters.

The kernel counts every fault a task takes (minflt and majflt, fields 10 and 12 of
/proc/PID/task/TID/stat); the collector reads them every `fault_bucket_ns` and writes
each thread's increase as a `faults` row spanning the time since the last read.  No
program runs on a fault: a probe on page_fault_user cost each of the ~10^5 faults a
second a training step takes 80-140 ns, more than any other probe on the benchmark
trainer (docs/performance.md, "Costs the code is shaped by"); reading a thread's counters costs ~3 µs.

The counters hold faults taken from user space and those the kernel takes on user memory
for the thread (a read() into a fresh buffer).  A thread born while recording starts
from zero (the kernel resets the counters at clone).  A thread's last counts, once it
exits, come from the kernel's exit statistics (taskstats over netlink, which sends every
exiting task's counters to a registered listener): a thread born and gone between two
reads is counted whole.  Without taskstats, what a thread faulted after its last read is
not counted: at most one read's worth.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import Collector, ThreadTable

# Fields after the comm's closing ")": state ppid pgrp session tty_nr tpgid flags minflt
# cminflt majflt (proc(5)).
MINFLT_FIELD = 7
MAJFLT_FIELD = 9
STAT_READ_BYTES = 1024  # a stat line is ~300 bytes
FLUSH_GRACE_NS = 1_000_000_000  # an ended thread waits this long for its exit statistics
# Stat files held open (a read is then one pread); beyond, as node-wide where every thread
# on the machine is read, a thread's file is opened at each read, so the recorder never
# runs out of descriptors.
MAX_HELD_STAT_FILES = 512


def read_faults(stat: int | str) -> int | None:
    """minflt + majflt of a task from its stat file, held open (a descriptor) or opened
    now (a path); None once the task is gone."""
    try:
        if isinstance(stat, int):
            text = os.pread(stat, STAT_READ_BYTES, 0)
        else:
            with open(stat, "rb", buffering=0) as fh:
                text = fh.read(STAT_READ_BYTES)
        fields = text[text.rindex(b")") + 2:].split()
        return int(fields[MINFLT_FIELD]) + int(fields[MAJFLT_FIELD])
    except (OSError, ValueError, IndexError):
        return None


# taskstats exit notifications (linux/taskstats.h): a generic netlink message whose
# TASKSTATS_TYPE_AGGR_PID attribute nests TASKSTATS_TYPE_STATS, a struct taskstats.  The
# struct only ever grows at its end, so these offsets hold for every version.
NLMSG_HEADER = struct.Struct("=IHHII")
GENL_HEADER_BYTES = 4
NLA_HEADER = struct.Struct("=HH")
NLA_TYPE_MASK = 0x3FFF
TASKSTATS_TYPE_STATS = 3
TASKSTATS_TYPE_AGGR_PID = 4
TASKSTATS_AC_PID = 128  # offsetof(struct taskstats, ac_pid)
TASKSTATS_AC_MINFLT = 168  # offsetof(struct taskstats, ac_minflt); ac_majflt follows
U32 = struct.Struct("=I")
TWO_U64 = struct.Struct("=QQ")


def _attributes(data: bytes, start: int, end: int):
    """(type, payload start, payload end) of the netlink attributes in data[start:end]."""
    while start + NLA_HEADER.size <= end:
        length, kind = NLA_HEADER.unpack_from(data, start)
        if length < NLA_HEADER.size or start + length > end:
            return
        yield kind & NLA_TYPE_MASK, start + NLA_HEADER.size, start + length
        start += (length + 3) & ~3


def exit_faults(data: bytes) -> dict[int, int]:
    """tid -> minflt + majflt of each task whose exit statistics `data` (what one read of
    the socket returned) holds; whatever does not parse is skipped."""
    out: dict[int, int] = {}
    offset = 0
    while offset + NLMSG_HEADER.size <= len(data):
        length = NLMSG_HEADER.unpack_from(data, offset)[0]
        if length < NLMSG_HEADER.size or offset + length > len(data):
            break
        for kind, start, end in _attributes(data, offset + NLMSG_HEADER.size + GENL_HEADER_BYTES, offset + length):
            if kind != TASKSTATS_TYPE_AGGR_PID:
                continue
            for inner, s, e in _attributes(data, start, end):
                if inner == TASKSTATS_TYPE_STATS and e - s >= TASKSTATS_AC_MINFLT + TWO_U64.size:
                    minflt, majflt = TWO_U64.unpack_from(data, s + TASKSTATS_AC_MINFLT)
                    out[U32.unpack_from(data, s + TASKSTATS_AC_PID)[0]] = minflt + majflt
        offset += (length + 3) & ~3
    return out


class ExitListener:
    """Each exiting task's fault counters, from taskstats exit notifications (pyroute2
    finds the netlink family and registers; the messages are parsed here: pyroute2's
    parser costs ~150 µs a message, and every exit on the machine sends one)."""

    RCVBUF_BYTES = 4 << 20  # ~7k exits' messages between two reads
    READ_BYTES = 65536

    def __init__(self):
        from pyroute2 import TaskStats

        self.cpus = f"0-{(os.cpu_count() or 1) - 1}"
        self.sock = TaskStats()
        try:
            self.sock.bind()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.RCVBUF_BYTES)
            self.sock.register_mask(self.cpus)
            self.fd = self.sock.fileno()
            os.set_blocking(self.fd, False)
        except Exception:
            self.sock.close()
            raise

    def take(self) -> dict[int, int]:
        """tid -> minflt + majflt of the tasks that exited since the last take."""
        out: dict[int, int] = {}
        while True:
            try:
                data = os.read(self.fd, self.READ_BYTES)
            except BlockingIOError:
                return out
            except OSError:  # an overrun (ENOBUFS): the exits it dropped are not counted
                continue
            if not data:
                return out
            out.update(exit_faults(data))

    def close(self) -> None:
        try:
            self.sock.deregister_mask(self.cpus)
        except Exception:
            pass
        self.sock.close()


class FaultsCollector(Collector):
    name = "faults"
    source = None  # no BPF: the kernel's per-thread counters (above)

    def __init__(self, settings, proc: str = "/proc"):
        super().__init__(settings)
        self.proc = proc
        self.threads = ThreadTable()  # the recorder's, from seeded()
        # tid -> [stat file (descriptor held, or path), tgid, faults at the last read, its time]
        self._open_threads: dict[int, list] = {}
        self._held = 0  # descriptors among them
        self._ended: dict[int, tuple[int, int, int]] = {}  # tid -> (tgid, faults, time) of its last read
        self._seen: set[int] = set()  # tids opened once
        self._exits: ExitListener | None = None
        self._exits_registered = False  # for the metadata: the listener is gone after close()
        # Exit counters not placed yet: tid -> (faults, the read before, the read that took them)
        self._exit_counts: dict[int, tuple[int, int, int]] = {}
        self._last_ns = 0
        self._rows: list[tuple[int, int, int, int, int]] = []  # (from ns, to ns, tid, tgid, faults)
        self._reads = 0
        self._read_cpu_ns = 0  # the recorder's CPU in the reads (meta: what counting costs)
        self._counted = 0

    def seeded(self, bpf, walked: list, threads: ThreadTable, now_ns: int) -> None:
        self.threads = threads
        try:
            self._exits = ExitListener()
            self._exits_registered = True
        except Exception as exc:  # no taskstats: a thread's faults after its last read are lost
            if self.notice:
                self.notice(f"faults of exiting threads are not counted after their last read (taskstats: {exc})")
        for t in walked:  # counting starts here, from what each thread has already faulted
            self._open(t.tid, t.pid, now_ns, born_while_recording=False)
        self._last_ns = now_ns

    def sample_interval_ns(self) -> int:
        return self.settings.fault_bucket_ns

    def sample(self, now_ns: int) -> None:
        """Read the counters when `fault_bucket_ns` has passed since the last read."""
        if now_ns - self._last_ns >= self.settings.fault_bucket_ns:
            self._read(now_ns)

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        if final:  # the last counts, then let the files go
            self._read(now_ns)
        self._place_exits(final=final)
        if final:
            self.close()
        rows, self._rows = self._rows, []
        if not rows:
            return []
        start, end, tid, pid, count = (np.array(col, dtype=np.int64) for col in zip(*rows))
        self._counted += int(count.sum())
        return [make_batch("faults", {
            "ts_ns": start, "dur_ns": end - start, "tid": tid.astype(np.int32), "pid": pid.astype(np.int32),
            "faults": count,
        })]

    def meta(self) -> dict:
        return {"faults": {"reads": self._reads, "counted": self._counted, "read_cpu_ns": self._read_cpu_ns,
                           "exit_counts": int(self._exits_registered)}}

    def close(self) -> None:
        for stat, *_ in self._open_threads.values():
            self._release(stat)
        self._open_threads.clear()
        if self._exits is not None:
            self._exits.close()
            self._exits = None

    # -- reading ---------------------------------------------------------------------
    def _open(self, tid: int, tgid: int, now_ns: int, *, born_while_recording: bool) -> None:
        if tid in self._seen:
            return
        stat: int | str = f"{self.proc}/{tgid}/task/{tid}/stat"
        if self._held < MAX_HELD_STAT_FILES:
            try:
                stat = os.open(stat, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # gone already: its exit statistics say what it faulted
                return
            self._held += 1
        faults = read_faults(stat)
        if faults is None:
            self._release(stat)
            return
        self._seen.add(tid)
        # A thread born since the last read: its counts since birth, from that read.
        self._open_threads[tid] = [stat, tgid, 0 if born_while_recording else faults,
                                   self._last_ns if born_while_recording else now_ns]

    def _release(self, stat: int | str) -> None:
        if isinstance(stat, int):
            os.close(stat)
            self._held -= 1

    def _read(self, now_ns: int) -> None:
        cpu_ns = time.thread_time_ns()
        self._read_counters(now_ns)
        self._read_cpu_ns += time.thread_time_ns() - cpu_ns
        self._reads += 1

    def _read_counters(self, now_ns: int) -> None:
        # Threads the recorder learnt of since the last read (at each flush), and those
        # born since the last flush, which only their process's task list shows yet.
        for tid, tgid in self.threads.live().items():
            self._open(tid, tgid, now_ns, born_while_recording=True)
        for tgid in {entry[1] for entry in self._open_threads.values()}:
            try:
                listed = os.listdir(f"{self.proc}/{tgid}/task")
            except OSError:
                continue
            for name in listed:
                self._open(int(name), tgid, now_ns, born_while_recording=True)
        for tid, entry in list(self._open_threads.items()):
            stat, tgid, before, since = entry
            faults = read_faults(stat)
            if faults is None:  # exited and reaped: the rest comes with its exit statistics
                self._release(stat)
                del self._open_threads[tid]
                self._ended[tid] = (tgid, before, since)
                continue
            if faults > before:
                self._rows.append((since, now_ns, tid, tgid, faults - before))
            entry[2:] = [faults, now_ns]
        if self._exits is not None:  # after the reads: a thread reaped before them has sent its own
            for tid, faults in self._exits.take().items():
                self._exit_counts[tid] = (faults, self._last_ns, now_ns)
        self._last_ns = now_ns

    def _place_exits(self, *, final: bool) -> None:
        """Rows for what exited threads faulted after their last read, at a flush: by
        then the recorder's thread table knows the threads born and gone between two
        reads.  Exits of tasks that are not ours (every exit on the machine reaches the
        listener) are dropped."""
        for tid, (faults, before_ns, taken_ns) in list(self._exit_counts.items()):
            entry = self._open_threads.get(tid)
            if entry is not None and entry[2] < faults and not final:
                continue  # sent at its exit, reaped after this read: its stat fails at the next
            del self._exit_counts[tid]
            if entry is not None:
                continue  # its last read saw what it sent
            ended = self._ended.pop(tid, None)
            tgid = ended[0] if ended else self.threads.tgid.get(tid)
            if tgid is None:
                continue
            before, since = ended[1:] if ended else (0, before_ns)
            if faults > before:
                self._rows.append((since, taken_ns, tid, tgid, faults - before))
        # Ended without exit statistics yet: they come with the next read, or never (no
        # taskstats; a socket overrun), and then what the thread did since its last read is lost.
        for tid in [t for t, (_, _, since) in self._ended.items() if final or since < self._last_ns - 2 * FLUSH_GRACE_NS]:
            del self._ended[tid]
