"""Collector for probes/sched.bpf.c: off-CPU intervals, short-wait sums, preemption
counts, thread table."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import (
    Collector,
    ThreadTable,
    cstrings,
    delete_keys,
    drain_hash,
    lookup_keys,
    py_stack_ids,
    read_hash,
    stack_ids,
)
from trainbpf.tracer.proctree import tgid_of

# The constants sched.bpf.c shares, passed to it as -D defines (defines() below).
# The state the probe reports for a task switched out while runnable (TASK_REPORT_MAX).
STATE_PREEMPTED = 0x100
# task_event.event codes (TASK_SEED, ...), and the `thread` row events they become.
TASK_WHAT = {0: "seed", 1: "thread", 2: "process", 3: "exec", 4: "rename", 5: "exit"}
TASK_EXEC, TASK_RENAME, TASK_EXIT = ({w: c for c, w in TASK_WHAT.items()}[what] for what in ("exec", "rename", "exit"))

# prev_state bits as sched_switch reports them (TASK_REPORT).
STATE_LETTERS = {STATE_PREEMPTED: "R", 0: "R", 1: "S", 2: "D", 4: "T", 8: "t", 16: "X", 32: "Z", 64: "P", 128: "I"}


# /proc state letter -> the prev_state bits sched_switch would have reported
PROC_STATE_BITS = {"S": 1, "D": 2, "T": 4, "t": 8, "I": 128}


# (thread, state) pairs with short waits one flush can sum (sched.bpf.c short_waits), one
# process tree's and the whole node's: every flush's drain walks each bucket (~0.3 ms at
# 65536), and a tree rarely has thousands of threads.  Past it, short waits count as lost.
SHORT_WAIT_ENTRIES = 16384
SHORT_WAIT_ENTRIES_NODE = 65536
# (traced thread, task that preempted it) pairs one flush can count (sched.bpf.c
# preemptions), likewise drained whole at each flush; past it, preemptions count as lost.
PREEMPTION_ENTRIES = 4096
PREEMPTION_ENTRIES_NODE = 16384
# task_events' ring buffer, in pages: forks, execs, renames and exits are few beside the
# switches sched_events carries, and 256 KiB holds thousands between two flushes.
TASK_RINGBUF_PAGES = 64

# Live threads up to which open_intervals looks each one up rather than reading the maps
# whole (a read walks all MAX_THREADS buckets; a lookup costs a few µs).
DIRECT_LOOKUPS = 2048


_STATE_BITS = np.array(sorted(STATE_LETTERS), dtype=np.int64)
_STATE_NAMES = np.array([STATE_LETTERS[b] for b in sorted(STATE_LETTERS)] + ["?"], dtype=object)


def state_letters(raw: np.ndarray) -> np.ndarray:
    """Map raw prev_state values to one letter; the lowest set bit wins (S|NOLOAD -> S).
    One lookup of each value's lowest bit in the sorted table, not a pass per letter."""
    raw = raw.astype(np.int64)
    low = raw & -raw  # lowest set bit; 0 for 0 (running)
    at = np.searchsorted(_STATE_BITS, low)
    known = _STATE_BITS[np.minimum(at, len(_STATE_BITS) - 1)] == low
    return _STATE_NAMES[np.where(known, at, len(_STATE_BITS))]


def _insert(table, tid: int, leaf) -> None:
    """Add an entry only if the key is absent (BPF_NOEXIST)."""
    import ctypes

    from bcc.libbcc import lib

    key = table.Key(tid)
    lib.bpf_update_elem(table.map_fd, ctypes.byref(key), ctypes.byref(leaf), 1)


class SchedCollector(Collector):
    name = "sched"
    source = "sched.bpf.c"
    tracepoints = (
        "sched:sched_switch",
        "sched:sched_waking",
        "task:task_newtask",
        "task:task_rename",
        "sched:sched_process_exec",
        "sched:sched_process_exit",
    )
    optional_raw_tracepoints = ("sched_exit_tp",)  # stacks at switch-in (see sched.bpf.c)
    ringbufs = ("sched_events", "task_events")

    def __init__(self, settings):
        super().__init__(settings)
        self.renamed: dict[int, int] = {}  # tid -> its last rename's ts_ns: where an exec began
        # Under sudo, whether the invoking user could see a process (access.Gate.sees):
        # a preempting task they could not is left unnamed.
        self.peer_visible: Callable[[int], bool] | None = None
        # tid -> tgid of the tasks the last drain saw preempting (-1: gone): a task that
        # keeps preempting is looked up in /proc once, not at every flush.
        self.peer_tgids: dict[int, int] = {}

    def defines(self) -> dict[str, int]:
        return {"STATE_PREEMPTED": STATE_PREEMPTED, "TASK_RINGBUF_PAGES": TASK_RINGBUF_PAGES,
                "SHORT_WAIT_ENTRIES": SHORT_WAIT_ENTRIES_NODE if self.settings.trace_all else SHORT_WAIT_ENTRIES,
                "PREEMPTION_ENTRIES": PREEMPTION_ENTRIES_NODE if self.settings.trace_all else PREEMPTION_ENTRIES,
                **{f"TASK_{what.upper()}": code for code, what in TASK_WHAT.items()}}

    def on_batch(self, ringbuf: str, records: np.ndarray, threads: ThreadTable) -> None:
        """task_events: threads born and exited, and execs (whose address space is new)."""
        if ringbuf != "task_events":
            return
        execs = records["event"] == TASK_EXEC
        comms = cstrings(records["comm"]) if execs.any() else []
        for i, (tid, pid, ts, what) in enumerate(zip(*(records[f].tolist() for f in ("tid", "pid", "ts_ns", "event")))):
            if what == TASK_EXIT:
                threads.exit(tid)
                self.renamed.pop(tid, None)
                continue
            threads.tgid.setdefault(tid, pid)
            if what == TASK_RENAME:  # an exec renames the task before its new credentials apply
                self.renamed[tid] = ts
            elif what == TASK_EXEC:
                threads.exec_log.append((tid, pid, min(ts, self.renamed.pop(tid, ts)), comms[i]))
        if execs.any():
            threads.exec_seen()

    def forget(self, bpf, tids: list[int]) -> None:
        """An exited thread's entry: its last switch-out and wake-up (sched.bpf.c leaves it)."""
        delete_keys(bpf["sched_threads"], tids)

    def open(self, session) -> None:
        super().open(session)
        if session.gate is not None:  # under sudo: a peer the invoking user could not see stays unnamed
            self.peer_visible = session.gate.sees
        # a process let back in: a wait since its exec begins when it joins
        session.threads.join_listeners.append(lambda walked, now_ns: self.seed_blocked(session.bpf, walked, now_ns))

    def seeded(self, bpf, walked, threads: ThreadTable, now_ns: int) -> None:
        self.seed_blocked(bpf, walked, now_ns)

    def still_open(self, bpf, threads: ThreadTable, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        """Off-CPU intervals still open: `offcpu` rows at the stop, `offcpu_open` at a flush."""
        return self.open_intervals(bpf, now_ns, set(threads.live()), kind="offcpu" if final else "offcpu_open")

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        if ringbuf == "sched_events":
            waker = r["peer_tid"] != 0
            return [
                make_batch(
                    "offcpu",
                    {
                        "ts_ns": r["ts_ns"].astype(np.int64),
                        "dur_ns": r["dur_ns"].astype(np.int64),
                        "tid": r["tid"].astype(np.int32),
                        "pid": r["pid"].astype(np.int32),
                        "cpu": r["cpu"],
                        "state": state_letters(r["state"]),
                        "runq_ns": r["runq_ns"].astype(np.int64),
                        "peer_tid": pa.array(r["peer_tid"].astype(np.int32), mask=~waker),
                        "peer_pid": pa.array(r["peer_pid"].astype(np.int32), mask=~waker),
                        "kstack_id": stack_ids(r["kstack_id"]),
                        "ustack_id": stack_ids(r["ustack_id"]),
                        "peer_kstack_id": stack_ids(r["peer_kstack_id"]),
                        "pystack_id": py_stack_ids(r["pystack_id"]),
                        "peer_pystack_id": py_stack_ids(r["peer_pystack_id"]),
                    },
                )
            ]
        return [self.task_batch(r)]

    @staticmethod
    def task_batch(r: np.ndarray) -> pa.RecordBatch:
        """task_events -> `thread` rows, and `exit` rows for exits."""
        what = np.array([TASK_WHAT.get(int(w), "?") for w in r["event"]], dtype=object)
        comm = np.array(cstrings(r["comm"]), dtype=object)
        exits = what == "exit"
        batches = []
        seen = ~exits
        if seen.any():
            batches.append(
                make_batch(
                    "thread",
                    {
                        "ts_ns": r["ts_ns"][seen].astype(np.int64),
                        "tid": r["tid"][seen].astype(np.int32),
                        "pid": r["pid"][seen].astype(np.int32),
                        "comm": comm[seen],
                        "peer_tid": pa.array(
                            r["peer_tid"][seen].astype(np.int32), mask=r["peer_tid"][seen] == 0
                        ),
                        "event": what[seen],
                    },
                )
            )
        if exits.any():
            batches.append(
                make_batch(
                    "exit",
                    {
                        "ts_ns": r["ts_ns"][exits].astype(np.int64),
                        "tid": r["tid"][exits].astype(np.int32),
                        "pid": r["pid"][exits].astype(np.int32),
                        "comm": comm[exits],
                    },
                )
            )
        return pa.concat_batches(batches) if len(batches) > 1 else batches[0]

    @staticmethod
    def seed_blocked(bpf, threads, now_ns: int) -> None:
        """Threads already off-CPU when tracing starts: their interval begins now, as if
        they had switched out at the start (else the wait would pass for running time)."""
        table = bpf["sched_threads"]
        for t in threads:
            bits = PROC_STATE_BITS.get(t.state)
            if bits is None:
                continue
            leaf = table.Leaf()  # no wake-up yet: woken.ts_ns 0
            out = leaf.out
            out.ts_ns, out.state, out.kstack_id, out.ustack_id, out.tgid = now_ns, bits, -1, -1, t.pid
            out.pystack_id = -1
            # NOEXIST: a real switch-out since attach is more accurate than the seed
            _insert(table, t.tid, leaf)

    def open_intervals(self, bpf, end_ns: int, live: set[int], kind: str = "offcpu") -> list[pa.RecordBatch]:
        """Off-CPU intervals still open when tracing stops (a thread blocked to the end,
        or never run again): they end at the stop, with cpu -1.  At a flush, as
        `kind` "offcpu_open" rows, they end at the flush."""
        if len(live) <= DIRECT_LOOKUPS:
            tid, entries = lookup_keys(bpf["sched_threads"], live)
        else:
            tid, entries = read_hash(bpf["sched_threads"])
        return self.open_interval_batches(tid, entries, end_ns, live, kind)

    def open_interval_batches(self, tid: np.ndarray, entries: np.ndarray, end_ns: int, live: set[int],
                              kind: str) -> list[pa.RecordBatch]:
        """open_intervals from sched_threads' entries (`tid`, `entries`: each thread's last
        switch-out `out` and wake-up `woken`), read after end_ns was taken."""
        outs = entries["out"]
        start = outs["ts_ns"].astype(np.int64)
        dur = end_ns - start
        # ts_ns 0: the thread is running (sched.bpf.c keeps its entry)
        keep = (start > 0) & (dur >= self.settings.min_block_ns) & np.isin(tid, np.fromiter(live, np.int64, len(live)))
        if not keep.any():
            return []
        tid, start, dur = tid[keep].astype(np.int64), start[keep], dur[keep]
        outs, wake = outs[keep], entries["woken"][keep]
        # The wake-up since the switch-out, if any: one stamped after end_ns (read from the
        # clock before the map) came after the stop: the thread was still blocked then.
        woke_ts = wake["ts_ns"].astype(np.int64)
        woke = (start <= woke_ts) & (woke_ts <= end_ns)
        state = outs["state"].astype(np.int64)
        preempted = (state == 0) | (state == STATE_PREEMPTED)
        runq = np.where(preempted, dur, np.where(woke, end_ns - woke_ts, 0))
        waker = np.where(woke, wake["peer_tid"], 0).astype(np.int32)
        return [make_batch(kind, {
            "ts_ns": start,
            "dur_ns": dur,
            "tid": tid.astype(np.int32),
            "pid": outs["tgid"].astype(np.int32),
            "cpu": np.full(len(tid), -1, dtype=np.int32),
            "state": state_letters(state),
            "runq_ns": runq,
            "peer_tid": pa.array(waker, mask=~woke),
            "peer_pid": pa.array(np.where(woke, wake["peer_pid"], 0).astype(np.int32), mask=~woke),
            "kstack_id": stack_ids(outs["kstack_id"]),
            "ustack_id": stack_ids(outs["ustack_id"]),
            "peer_kstack_id": stack_ids(np.where(woke, wake["kstack_id"], -1)),
            "pystack_id": py_stack_ids(outs["pystack_id"]),
        })]

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        return self.short_waits(bpf, now_ns) + self.preempted_by(bpf, now_ns)

    @staticmethod
    def short_waits(bpf, now_ns: int) -> list[pa.RecordBatch]:
        keys, sums = drain_hash(bpf["short_waits"])
        if not len(keys):
            return []
        return [
            make_batch(
                "offcpu_short",
                {
                    "ts_ns": np.full(len(keys), now_ns, dtype=np.int64),
                    "dur_ns": sums["dur_ns"].astype(np.int64),
                    "tid": keys["tid"].astype(np.int32),
                    "pid": sums["pid"].astype(np.int32),
                    "state": state_letters(keys["state"]),
                    "intervals": sums["intervals"].astype(np.int64),
                    "runq_ns": sums["runq_ns"].astype(np.int64),
                },
            )
        ]

    def preempted_by(self, bpf, now_ns: int) -> list[pa.RecordBatch]:
        """The preemptions counted since the last flush, as `preempted_by` rows; a task
        that `peer_visible` says the invoking user could not see is left unnamed."""
        keys, counts = drain_hash(bpf["preemptions"])
        known, self.peer_tgids = self.peer_tgids, {}
        for tid in np.unique(keys["peer_tid"]).tolist():
            self.peer_tgids[tid] = known[tid] if tid in known else tgid_of(tid)
        hidden = {tid for tid, tgid in self.peer_tgids.items()
                  if self.peer_visible is not None and not self.peer_visible(tgid if tgid > 0 else tid)}
        return preempted_by_batches(keys, counts, now_ns, self.peer_tgids, hidden=hidden)


def preempted_by_batches(keys: np.ndarray, counts: np.ndarray, now_ns: int,
                         peer_tgids: dict[int, int], *, hidden: set[int] = frozenset()) -> list[pa.RecordBatch]:
    """`preempted_by` rows of sched.bpf.c's preemptions (`keys`: tid, peer_tid; `counts`:
    preemptions, pid, comm), each peer's tgid from `peer_tgids` (-1 or absent: gone, null); a
    peer in `hidden` becomes tid 0, no pid, comm "" (another user's task, unnamed)."""
    if not len(keys):
        return []
    peer = keys["peer_tid"].astype(np.int64)
    peer_pid = np.array([peer_tgids.get(t, -1) for t in peer.tolist()], dtype=np.int32)
    unnamed = np.isin(peer, list(hidden))
    peer, peer_pid = np.where(unnamed, 0, peer), np.where(unnamed, -1, peer_pid).astype(np.int32)
    comm = np.array(cstrings(counts["comm"]), dtype=object)
    comm[unnamed] = ""
    return [make_batch("preempted_by", {
        "ts_ns": np.full(len(keys), now_ns, dtype=np.int64),
        "tid": keys["tid"].astype(np.int32),
        "pid": counts["pid"].astype(np.int32),
        "peer_tid": peer.astype(np.int32),
        "peer_pid": pa.array(peer_pid, mask=peer_pid < 0),
        "comm": comm,
        "preemptions": counts["preemptions"].astype(np.int64),
    })]
