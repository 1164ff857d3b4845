"""Collector for probes/sched.bpf.c: off-CPU intervals, short-wait sums, thread table."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainbpf.tracefile import make_batch
from trainbpf.tracer.collector import Collector, ThreadTable, cstrings, drain_hash, py_stack_ids, stack_ids

# The constants sched.bpf.c shares, passed to it as -D defines (defines() below).
# The state the probe reports for a task switched out while runnable (TASK_REPORT_MAX).
STATE_PREEMPTED = 0x100
# task_event.what codes (TASK_SEED, ...), and the `thread` row names they become.
TASK_WHAT = {0: "seed", 1: "thread", 2: "process", 3: "exec", 4: "rename", 5: "exit"}
TASK_EXEC, TASK_EXIT = ({w: c for c, w in TASK_WHAT.items()}[what] for what in ("exec", "exit"))

# prev_state bits as sched_switch reports them (TASK_REPORT).
STATE_LETTERS = {STATE_PREEMPTED: "R", 0: "R", 1: "S", 2: "D", 4: "T", 8: "t", 16: "X", 32: "Z", 64: "P", 128: "I"}


# /proc state letter -> the prev_state bits sched_switch would have reported
PROC_STATE_BITS = {"S": 1, "D": 2, "T": 4, "t": 8, "I": 128}


def state_letters(raw: np.ndarray) -> np.ndarray:
    """Map raw prev_state values to one letter; the lowest set bit wins (S|NOLOAD -> S)."""
    raw = raw.astype(np.int64)
    low = raw & -raw  # lowest set bit
    out = np.full(raw.shape, "?", dtype=object)
    for bit, letter in STATE_LETTERS.items():
        out[low == bit] = letter
    out[(raw == 0) | (raw == STATE_PREEMPTED)] = "R"
    return out


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

    def defines(self) -> dict[str, int]:
        return {"MIN_BLOCK_NS": self.settings.min_block_ns, "STATE_PREEMPTED": STATE_PREEMPTED,
                **{f"TASK_{what.upper()}": code for code, what in TASK_WHAT.items()}}

    def on_batch(self, ringbuf: str, records: np.ndarray, threads: ThreadTable) -> None:
        """task_events: threads born and exited, and execs (whose address space is new)."""
        if ringbuf != "task_events":
            return
        for tid, pid, what in zip(records["tid"].tolist(), records["pid"].tolist(), records["what"].tolist()):
            if what == TASK_EXIT:
                threads.exited.add(tid)
            else:
                threads.tgid.setdefault(tid, pid)
        if (records["what"] == TASK_EXEC).any():
            threads.exec_seen()

    def seeded(self, bpf, walked, threads: ThreadTable, now_ns: int) -> None:
        self.seed_blocked(bpf, walked, now_ns)

    def still_open(self, bpf, threads: ThreadTable, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        """Off-CPU intervals still open: `offcpu` rows at the stop, `offcpu_open` at a flush."""
        return self.open_intervals(bpf, now_ns, set(threads.live()), kind="offcpu" if final else "offcpu_open")

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        if ringbuf == "sched_events":
            waker = r["waker_tid"] != 0
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
                        "peer_tid": pa.array(r["waker_tid"].astype(np.int32), mask=~waker),
                        "peer_pid": pa.array(r["waker_pid"].astype(np.int32), mask=~waker),
                        "kstack_id": stack_ids(r["kstack_id"]),
                        "ustack_id": stack_ids(r["ustack_id"]),
                        "peer_kstack_id": stack_ids(r["waker_kstack_id"]),
                        "peer_ustack_id": stack_ids(r["waker_ustack_id"]),
                        "pystack_id": py_stack_ids(r["pystack_id"]),
                        "peer_pystack_id": py_stack_ids(r["waker_pystack_id"]),
                    },
                )
            ]
        return [self.task_batch(r)]

    @staticmethod
    def task_batch(r: np.ndarray) -> pa.RecordBatch:
        """task_events -> `thread` rows, and `exit` rows for exits."""
        what = np.array([TASK_WHAT.get(int(w), "?") for w in r["what"]], dtype=object)
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
                            r["parent_tid"][seen].astype(np.int32), mask=r["parent_tid"][seen] == 0
                        ),
                        "name": what[seen],
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
        table = bpf["switched_out_at"]
        for t in threads:
            bits = PROC_STATE_BITS.get(t.state)
            if bits is None:
                continue
            leaf = table.Leaf()
            leaf.ts_ns, leaf.state, leaf.kstack_id, leaf.ustack_id, leaf.tgid = now_ns, bits, -1, -1, t.pid
            leaf.pystack_id = -1
            # NOEXIST: a real switch-out since attach is more accurate than the seed
            _insert(table, t.tid, leaf)

    def open_intervals(self, bpf, end_ns: int, live: set[int], kind: str = "offcpu") -> list[pa.RecordBatch]:
        """Off-CPU intervals still open when tracing stops (a thread blocked to the end,
        or never run again): they end at the stop, with cpu -1.  At a flush, as
        `kind` "offcpu_open" rows, they end at the flush."""
        woken = {k.value: v for k, v in bpf["woken_at"].items()}
        rows = []
        for k, so in bpf["switched_out_at"].items():
            tid = k.value
            dur = end_ns - so.ts_ns
            if tid not in live or dur < self.settings.min_block_ns or so.ts_ns > end_ns:
                continue
            w = woken.get(tid)
            # A waking stamped after end_ns (read from the clock before the maps) came
            # after the stop: the thread was still blocked then.
            woke = w is not None and so.ts_ns <= w.ts_ns <= end_ns
            preempted = so.state in (0, STATE_PREEMPTED)
            runq = dur if preempted else (end_ns - w.ts_ns if woke else 0)
            rows.append((so.ts_ns, dur, tid, so.tgid, so.state, runq,
                         w.waker_tid if woke else 0, w.waker_pid if woke else 0,
                         so.kstack_id, so.ustack_id, w.kstack_id if woke else -1, so.pystack_id))
        if not rows:
            return []
        cols = list(zip(*rows))
        waker = np.array(cols[6], dtype=np.int32)
        return [make_batch(kind, {
            "ts_ns": np.array(cols[0], dtype=np.int64),
            "dur_ns": np.array(cols[1], dtype=np.int64),
            "tid": np.array(cols[2], dtype=np.int32),
            "pid": np.array(cols[3], dtype=np.int32),
            "cpu": np.full(len(rows), -1, dtype=np.int32),
            "state": state_letters(np.array(cols[4], dtype=np.int64)),
            "runq_ns": np.array(cols[5], dtype=np.int64),
            "peer_tid": pa.array(waker, mask=waker == 0),
            "peer_pid": pa.array(np.array(cols[7], dtype=np.int32), mask=waker == 0),
            "kstack_id": stack_ids(np.array(cols[8], dtype=np.int32)),
            "ustack_id": stack_ids(np.array(cols[9], dtype=np.int32)),
            "peer_kstack_id": stack_ids(np.array(cols[10], dtype=np.int32)),
            "peer_ustack_id": np.full(len(rows), -1, dtype=np.int32),
            "pystack_id": py_stack_ids(np.array(cols[11], dtype=np.int32)),
        })]

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        items = drain_hash(bpf["short_waits"])
        if not items:
            return []
        tid = np.array([k.tid for k, _ in items], dtype=np.int32)
        state = np.array([k.state for k, _ in items], dtype=np.int64)
        return [
            make_batch(
                "offcpu_short",
                {
                    "ts_ns": np.full(len(items), now_ns, dtype=np.int64),
                    "dur_ns": np.array([v.dur_ns for _, v in items], dtype=np.int64),
                    "tid": tid,
                    "pid": np.array([v.pid for _, v in items], dtype=np.int32),
                    "state": state_letters(state),
                    "count": np.array([v.count for _, v in items], dtype=np.int64),
                    "runq_ns": np.array([v.runq_ns for _, v in items], dtype=np.int64),
                },
            )
        ]
