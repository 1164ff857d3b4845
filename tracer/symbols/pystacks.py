"""The recorder's side of the CPython frame walk (probes/pyframes.h, docs/python-frames.md).

It tells the kernel which traced processes run a CPython whose layout passed the
self-test (tracer/symbols/pyruntime.py) and where each of their threads keeps its state, and it
turns the stacks the kernel interned into `stack` rows of space "python", naming each
frame (file, function, line) from the process's own code objects while it lives.

A thread is looked for in its interpreter's thread list when it is first seen, and again
at the next few flushes: a new Python thread enters the list only once it runs.  A
process whose layout fails the self-test keeps native stacks only, and its status says
why (trace metadata `python_frames`)."""

from __future__ import annotations

import ctypes
from collections import defaultdict
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.schema import PY_STACK_ID_BASE
from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import ThreadTable
from trainbpf.tracer.symbols import pyruntime
from trainbpf.tracer.symbols.pycode import CodeNamer

THREAD_LOOKS = 5  # flushes a thread is looked for in its interpreter's thread list
ATTACH_TRIES = 3  # flushes a CPython whose layout was refused is tried again
# The kernel walk's constants (probes/pyframes.h, passed as -D by the loader):
# one read of FRAME_WINDOW bytes per frame holds every field the walk needs (the largest
# offset + 8 is < 128 in 3.10 to 3.13); a power of two, so offsets can be masked.
FRAME_WINDOW = 128
MAX_FRAMES = 16  # Python frames kept per stack; a power of two, so the walk can mask its index
PROCESSES = 1024  # Python processes whose frame layouts the kernel holds


def probe_defines() -> dict[str, int]:
    """The -D defines of the walk's constants: PY_FRAME_BYTES, PY_MAX_FRAMES, PY_PROCESSES."""
    return {"PY_FRAME_BYTES": FRAME_WINDOW, "PY_MAX_FRAMES": MAX_FRAMES, "PY_PROCESSES": PROCESSES}


def kernel_layout(proc: pyruntime.PyProcess, leaf) -> None:
    """Fill a `struct py_layout` (probes/pyframes.h) from `proc`'s offsets."""
    off = proc.offsets
    if "ts.cframe" in off:
        leaf.ts_cframe, leaf.current_frame = off["ts.cframe"], off["cframe.current_frame"]
    else:
        leaf.ts_cframe, leaf.current_frame = -1, off["ts.current_frame"]
    leaf.previous, leaf.code, leaf.instr = off["frame.previous"], off["frame.executable"], off["frame.instr_ptr"]
    leaf.owner = off.get("frame.owner", -1)
    leaf.frame_bytes = max(leaf.previous + 8, leaf.code + 8, leaf.instr + 8, leaf.owner + 1)
    if leaf.frame_bytes > FRAME_WINDOW:
        raise pyruntime.PyRuntimeError(f"a frame's fields end at byte {leaf.frame_bytes}, past the walk's window")
    # 3.10 counts instructions in an int (f_lasti); later versions keep a pointer.
    leaf.instr_mask = 0xFFFFFFFF if proc.version == "3.10" else (1 << 64) - 1


class PythonStacks:
    def __init__(self, bpf, *, cpus: int, stack_entries: int, notice: Callable[[str], None] | None = None):
        """`cpus` and `stack_entries`: the kernel table's PY_CPUS and PY_STACK_ENTRIES."""
        self.bpf = bpf
        self.cpus = cpus
        self.notice = notice
        self.processes: dict[int, pyruntime.PyProcess] = {}
        self.namers: dict[int, CodeNamer] = {}
        self.status: dict[int, dict] = {}  # pid -> {"version", "status"}, for the metadata
        self.looks: dict[int, int] = {}  # tid -> looks left; absent once found or given up
        self.settled: set[int] = set()  # tids found or given up
        self.exits_read = 0  # ThreadTable.exit_log entries already seen
        self.attempts: dict[int, int] = defaultdict(int)  # pid -> attaches tried
        self.tstates: dict[int, int] = {}  # tid -> PyThreadState, as given to the kernel
        self.slots_read: list[int] = []  # per CPU: slots already named
        self.next_user_id = PY_STACK_ID_BASE + stack_entries  # ids of stacks walked from user space
        self.stacks = 0
        self.unnamed = 0

    # -- threads and processes ---------------------------------------------------------
    def track(self, threads: ThreadTable) -> None:
        """Tell the kernel about threads and processes seen since the last call."""
        live = threads.live()
        exits, self.exits_read = threads.exit_log[self.exits_read:], len(threads.exit_log)
        for tid in exits:  # only the exits since the last call: a long recording has thousands
            self.looks.pop(tid, None)
            if tid in self.settled:
                self._forget_thread(tid)
        wanted: dict[int, list[int]] = defaultdict(list)
        for tid, pid in live.items():
            if tid in self.settled:
                continue
            self.looks.setdefault(tid, THREAD_LOOKS)
            wanted[pid].append(tid)
        for pid, tids in wanted.items():
            found = self._thread_states(pid)
            refused = pid not in self.processes and not self._may_retry(pid)
            for tid in tids:
                if tid in found:
                    self.bpf["py_threads"][ctypes.c_uint32(tid)] = ctypes.c_uint64(found[tid])
                    self.tstates[tid] = found[tid]
                    self._settle(tid)
                else:
                    self.looks[tid] -= 1
                    if self.looks[tid] <= 0 or refused:
                        self._settle(tid)
        live_pids = set(live.values())
        for pid in [p for p in self.processes if p not in live_pids]:
            self._forget_process(pid)

    def exec_seen(self) -> None:
        """An exec replaced some process's address space: look at every process anew."""
        for pid in list(self.processes):
            self._forget_process(pid)
        self.status.clear()
        self.attempts.clear()
        self.settled.clear()
        self.looks.clear()
        self.bpf["py_threads"].clear()
        self.tstates.clear()

    def _settle(self, tid: int) -> None:
        self.looks.pop(tid, None)
        self.settled.add(tid)

    def _thread_states(self, pid: int) -> dict[int, int]:
        """tid -> PyThreadState of `pid`'s interpreter, attaching to it when new."""
        proc = self.processes.get(pid)
        if proc is None:
            if pid in self.status and not self._may_retry(pid):
                return {}
            proc = self._attach(pid)
            return proc.threads if proc else {}
        try:
            return pyruntime.thread_states(self.namers[pid].mem, proc.runtime, proc.offsets)
        except pyruntime.PyRuntimeError:
            return {}

    def _may_retry(self, pid: int) -> bool:
        """A CPython refused fewer than ATTACH_TRIES times: the thread list can read torn
        while threads start (the interpreter changes it under its own lock)."""
        status = self.status.get(pid)
        return status is None or (status["version"] is not None and self.attempts[pid] < ATTACH_TRIES)

    def _attach(self, pid: int) -> pyruntime.PyProcess | None:
        self.attempts[pid] += 1
        try:
            proc = pyruntime.attach(pid)
            leaf = self.bpf["py_layouts"].Leaf()
            kernel_layout(proc, leaf)
            namer = CodeNamer(proc)
        except (pyruntime.PyRuntimeError, OSError) as err:
            version = getattr(err, "version", None)
            self.status[pid] = {"version": version, "status": _one_line(err)}
            if self.notice and version and not self._may_retry(pid):
                self.notice(f"process {pid}: native stacks only: {_one_line(err)}")
            return None
        self.bpf["py_layouts"][ctypes.c_uint32(pid)] = leaf
        self.processes[pid], self.namers[pid] = proc, namer
        self.status[pid] = {"version": proc.version, "status": "ok"}
        return proc

    def _forget_thread(self, tid: int) -> None:
        self.settled.discard(tid)
        self.tstates.pop(tid, None)
        try:
            del self.bpf["py_threads"][ctypes.c_uint32(tid)]
        except KeyError:
            pass

    def _forget_process(self, pid: int) -> None:
        self.processes.pop(pid, None)
        namer = self.namers.pop(pid, None)
        if namer is not None:
            namer.close()
        try:
            del self.bpf["py_layouts"][ctypes.c_uint32(pid)]
        except KeyError:
            pass

    # -- stacks ------------------------------------------------------------------------
    def take(self, now_ns: int) -> pa.RecordBatch | None:
        """`stack` rows for the stacks the kernel interned since the last call."""
        used = self.bpf["py_slots_used"][ctypes.c_int(0)]
        cpus = self.cpus
        if not self.slots_read:
            self.slots_read = [0] * cpus
        stacks = self.bpf["py_stacks"]
        ids, pids, names = [], [], []
        for cpu in range(min(cpus, len(used))):
            for n in range(self.slots_read[cpu], int(used[cpu])):
                slot = n * cpus + cpu
                st = stacks[ctypes.c_int(slot)]
                frames = self._name(st)
                if frames:
                    ids.append(PY_STACK_ID_BASE + slot)
                    pids.append(st.pid)
                    names.append(";".join(frames))
                else:
                    self.unnamed += 1
            self.slots_read[cpu] = int(used[cpu])
        return self._stack_rows(now_ns, ids, pids, names)

    def _stack_rows(self, now_ns: int, ids: list[int], pids: list[int], names: list[str]) -> pa.RecordBatch | None:
        if not ids:
            return None
        self.stacks += len(ids)
        return make_batch("stack", {
            "ts_ns": np.full(len(ids), now_ns, dtype=np.int64),
            "stack_id": np.array(ids, dtype=np.int32),
            "space": ["python"] * len(ids),
            "pid": np.array(pids, dtype=np.int32),
            "frames": names,
        })

    def _name(self, st) -> list[str]:
        namer = self.namers.get(st.pid)
        if namer is None:
            return []
        depth = min(int(st.depth), len(st.code))
        return namer.stack([(int(st.code[i]), int(st.instr[i])) for i in range(depth)])

    def fill_blocked(self, batch: pa.RecordBatch, now_ns: int) -> list[pa.RecordBatch]:
        """`batch` (off-CPU rows still open at the stop) with the Python stacks of its
        threads read now, from user space, where the kernel has none (it takes them at a
        switch-in that never came); and their `stack` rows.  A blocked thread's frames do
        not move, so this is the stack it blocked with."""
        names = batch.schema.names
        if not batch.num_rows or batch.column(names.index("kind"))[0].as_py() != "offcpu":
            return [batch]
        column = names.index("pystack_id")
        own = batch.column(column).to_pylist()
        tids, pids = batch.column(names.index("tid")).to_pylist(), batch.column(names.index("pid")).to_pylist()
        ids, stack_pids, frames = [], [], []
        for i, (tid, pid) in enumerate(zip(tids, pids)):
            walked = self._walk_now(tid, pid) if own[i] is None else None
            if walked:
                own[i] = self.next_user_id
                self.next_user_id += 1
                ids.append(own[i])
                stack_pids.append(pid)
                frames.append(";".join(walked))
        if not ids:
            return [batch]
        cols = list(batch.columns)
        cols[column] = pa.array(own, type=pa.int32())
        out = [pa.RecordBatch.from_arrays(cols, schema=batch.schema)]
        return out + [self._stack_rows(now_ns, ids, stack_pids, frames)]

    def _walk_now(self, tid: int, pid: int) -> list[str]:
        namer, proc, ts = self.namers.get(pid), self.processes.get(pid), self.tstates.get(tid)
        if namer is None or proc is None or ts is None:
            return []
        try:
            return namer.stack(pyruntime.python_frames(namer.mem, ts, proc.offsets))
        except pyruntime.PyRuntimeError:
            return []

    def close(self) -> None:
        for pid in list(self.processes):
            self._forget_process(pid)

    def meta(self) -> dict:
        counts = [int(sum(self.bpf["py_counts"][ctypes.c_int(i)])) for i in range(3)]
        return {"python_frames": {
            "enabled": True,
            "processes": {str(pid): s for pid, s in sorted(self.status.items())},
            "walks": counts[0], "empty_walks": counts[1], "stacks_lost": counts[2],
            "stacks": self.stacks, "stacks_unnamed": self.unnamed,
        }}


def _one_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__
