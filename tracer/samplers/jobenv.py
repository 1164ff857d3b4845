"""Which rank of a multi-process job each traced process is, from its environment
(docs/trace-format.md, `process_env`; docs/security.md, "What a trace contains").

Launchers (torchrun, srun, mpirun) tell each rank who it is through environment
variables.  The recorder reads /proc/PID/environ of every traced process once per
program it runs (when it is seeded or forked, and again after each exec: a launcher
forks, then the child execs the rank's program with the rank's environment) and keeps
only the variables of JOB_VARIABLES: nothing else of any environment is stored, logged
or kept past the parse."""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.jobvars import first_number
from trainbpf.trace.printable import printable
from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import ThreadTable

# The only variables ever kept: torchrun / torch elastic, Slurm, Open MPI, PMI / PMIx
# (MPICH, Intel MPI), and which GPUs the process may see.
JOB_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
    "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_STEP_ID",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALRANKID",
)
_WANTED = frozenset(v.encode() for v in JOB_VARIABLES)

ENVIRON_MAX_BYTES = 1 << 20  # read of /proc/PID/environ; what lies beyond is not looked at
VALUE_MAX_CHARS = 256  # a value kept, escapes included


def _value(raw: bytes) -> str:
    """`raw` as text: bytes that are not UTF-8 (and control characters) as their escapes
    (printable), cut to at most VALUE_MAX_CHARS characters between two escapes."""
    out, size = [], 0
    for ch in raw.decode("utf-8", "surrogateescape")[:VALUE_MAX_CHARS]:
        piece = printable(ch)
        if size + len(piece) > VALUE_MAX_CHARS:
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)


def parse_environ(raw: bytes) -> dict[str, str]:
    """The JOB_VARIABLES set in `raw` (a /proc/PID/environ: NUL-separated NAME=VALUE),
    in JOB_VARIABLES order; an entry without '=' is skipped, and of a name set twice the
    first counts (as getenv reads it)."""
    found: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, eq, value = entry.partition(b"=")
        if eq and name in _WANTED and name.decode() not in found:
            found[name.decode()] = _value(value)
    return {v: found[v] for v in JOB_VARIABLES if v in found}


def read_environ(pid: int) -> dict[str, str] | None:
    """The JOB_VARIABLES of process `pid` (parse_environ of its first ENVIRON_MAX_BYTES),
    None when it is gone or its environment cannot be read."""
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    chunks, size = [], 0
    try:
        while size < ENVIRON_MAX_BYTES:
            chunk = os.read(fd, ENVIRON_MAX_BYTES - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if size >= ENVIRON_MAX_BYTES:  # cut: the last entry may be part of one
        raw = raw[: raw.rfind(b"\0") + 1]
    return parse_environ(raw)


def rank_of(env: dict[str, str]) -> tuple[int | None, int | None]:
    """(global rank, world size) that `env` gives, each None where no variable says
    (trace/jobvars.py: as the analysis reads them)."""
    return first_number(env, "rank"), first_number(env, "world_size")


def job_meta(env: dict[str, str] | None) -> dict:
    """The trace metadata's `job`: the target's own rank and world size."""
    rank, world = rank_of(env or {})
    return {"target_rank": rank, "world_size": world}


def lone_rank_note(pid: int, env: dict[str, str] | None, others: list[dict[str, str]]) -> str | None:
    """The line `record --pid` prints when the target is one rank of a larger job and no
    other rank runs below it (`others`: the environments read in its tree)."""
    rank, world = rank_of(env or {})
    if rank is None or world is None or world < 2 or any(rank_of(e)[0] not in (None, rank) for e in others):
        return None
    others_text = "the other rank is" if world == 2 else f"the other {world - 1} ranks are"
    return (f"note: pid {pid} is rank {rank} of {world}; {others_text} not traced "
            f"(record the launcher's pid to trace every rank)")


class JobEnvReader:
    """`process_env` rows for the traced processes: each read once per program it runs,
    found through the thread table (new tgids, and the exec log).  `admitted(pid)`, when
    given, is asked after each read: a process that fails it (under sudo, one the user
    could no longer ptrace, e.g. after a setuid exec) has its read thrown away."""

    def __init__(self, admitted: Callable[[int], bool] | None = None):
        self.admitted = admitted
        self.envs: dict[int, dict[str, str]] = {}  # pid -> its variables as last written
        self._read_at: dict[int, int] = {}  # pid -> its exec count when last read
        self._execs: dict[int, int] = {}  # pid -> execs seen in the exec log
        self._tids_seen = 0  # ThreadTable.tgid entries already looked at (it only grows)
        self._execs_seen = 0  # ThreadTable.exec_log entries already looked at

    def read(self, pid: int) -> dict[str, str] | None:
        """read_environ(pid), None also when `pid` is not admitted once read."""
        env = read_environ(pid)
        return None if env is None or (self.admitted is not None and not self.admitted(pid)) else env

    def take(self, threads: ThreadTable) -> pa.RecordBatch | None:
        """Rows of the processes that joined or exec'd since the last call.  A read in the
        middle of an exec (the new program's environment not yet laid out) sees none; the
        exec's own event, which comes after, has it read again."""
        pending: set[int] = set()
        if len(threads.tgid) > self._tids_seen:
            pending.update(list(threads.tgid.values())[self._tids_seen:])
            self._tids_seen = len(threads.tgid)
        for _tid, pid, _ts, _comm in threads.exec_log[self._execs_seen:]:
            self._execs[pid] = self._execs.get(pid, 0) + 1
            pending.add(pid)
        self._execs_seen = len(threads.exec_log)
        rows: list[tuple[int, int, str, str]] = []
        for pid in sorted(pending - threads.untraced):
            execs = self._execs.get(pid, 0)
            if self._read_at.get(pid) == execs or pid in threads.exited:  # read, or gone (its pid may be reused)
                continue
            self._read_at[pid] = execs
            env = self.read(pid)
            if env is None:
                continue
            if env != self.envs.get(pid):  # an exec seen after the read that saw its program
                self.envs[pid] = env
                now = time.monotonic_ns()
                rows += [(now, pid, name, value) for name, value in env.items()]
        if not rows:
            return None
        ts, pids, names, values = zip(*rows)
        return make_batch("process_env", {"ts_ns": np.array(ts, dtype=np.int64),
                                          "pid": np.array(pids, dtype=np.int32),
                                          "variable": list(names), "value": list(values)})
