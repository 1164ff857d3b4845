"""The ranks of a multi-process job: which traced processes are ranks, which are
launchers, and which rank each thread works for (docs/findings.md, "Multi-process jobs").

A rank is known by its environment (the `process_env` rows: RANK, LOCAL_RANK,
WORLD_SIZE and the Slurm, Open MPI and PMI equivalents), else by behaviour: a process
with threads of a collective backend (gloo, NCCL).  A process that inherited its
parent's rank (a DataLoader worker) works for that rank; a process above ranks (torchrun,
its elastic agent, srun, a shell) is a launcher and never a trainer."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import as_int64
from trainbpf.analyzers.threads.roles import NAME_ROLES, carried_on_by
from trainbpf.trace.jobvars import JOB_KEY_VARIABLES, RANK_VARIABLES, number

# Launchers and their agents by name (comm, lower-cased): never a trainer.
LAUNCHER_COMMS = re.compile(
    r"^(torchrun|pt_elastic|deepspeed|accelerate|mpirun|mpiexec|orterun|prterun|orted|prted|srun|slurmstepd"
    r"|hydra_pmi_proxy|sh|bash|dash|zsh)$")
# Threads of a collective backend (the role's name pattern): their wake-ups of a trainer end a collective.
COLLECTIVE_COMMS = re.compile(dict(NAME_ROLES)["collective"])

RANK_COLUMNS = ("rank", "local_rank", "world_size", "pid", "trainer_tid", "job", "source")


def empty_ranks() -> pd.DataFrame:
    return pd.DataFrame({
        "rank": np.zeros(0, np.int64), "local_rank": np.zeros(0, np.int64), "world_size": np.zeros(0, np.int64),
        "pid": np.zeros(0, np.int64), "trainer_tid": np.zeros(0, np.int64),
        "job": pd.Series([], dtype=object), "source": pd.Series([], dtype=object)})


def process_fields(env: pd.DataFrame) -> pd.DataFrame:
    """Per pid, from its newest environment (`process_env` rows: pid, variable, value):
    rank, local_rank, world_size (-1 where unset), the variable the rank came from, the
    job key (the JOB_KEY_VARIABLES present, joined) and CUDA_VISIBLE_DEVICES ("" unset)."""
    if not len(env):
        return pd.DataFrame({"pid": np.zeros(0, np.int64), "rank": np.zeros(0, np.int64),
                             "local_rank": np.zeros(0, np.int64), "world_size": np.zeros(0, np.int64),
                             "rank_variable": pd.Series([], dtype=object), "job": pd.Series([], dtype=object),
                             "visible_devices": pd.Series([], dtype=object)})
    env = pd.DataFrame({"pid": as_int64(env["pid"]), "ts_ns": as_int64(env["ts_ns"]),
                        "variable": env["variable"].astype(str), "value": env["value"].astype(str)})
    newest = env.groupby("pid")["ts_ns"].transform("max")
    table = env[env["ts_ns"] == newest].drop_duplicates(["pid", "variable"], keep="last").pivot(
        index="pid", columns="variable", values="value")
    out = pd.DataFrame({"pid": table.index.to_numpy(np.int64)})
    for field, names in RANK_VARIABLES.items():
        values = np.full(len(table), -1, np.int64)
        source = np.full(len(table), "", dtype=object)
        for name in reversed(names):  # the strongest variable present wins
            if name in table:
                got = np.array([number(v) if isinstance(v, str) else -1 for v in table[name]], np.int64)
                values = np.where(got >= 0, got, values)
                source = np.where(got >= 0, name, source)
        out[field] = values
        if field == "rank":
            out["rank_variable"] = source
    job = [";".join(f"{n}={row[n]}" for n in JOB_KEY_VARIABLES if n in table and isinstance(row.get(n), str))
           for _, row in table.iterrows()]
    out["job"] = np.array(job, dtype=object)
    devices = table["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in table else pd.Series("", index=table.index)
    out["visible_devices"] = devices.fillna("").astype(str).to_numpy(dtype=object)
    return out


def parents(threads: pd.DataFrame, thread_rows: pd.DataFrame) -> dict[int, int]:
    """Each traced process's parent process: from its seed or creation row's creator."""
    rows = thread_rows[as_int64(thread_rows["tid"]) == as_int64(thread_rows["pid"])]
    rows = rows[rows["event"].astype(str).isin(["seed", "process"])]
    pid_of = dict(zip(threads["tid"].tolist(), threads["pid"].tolist()))
    out = {}
    for pid, creator in zip(as_int64(rows["pid"]), as_int64(rows["peer_tid"], -1)):
        if creator > 0:
            out[int(pid)] = int(pid_of.get(int(creator), creator))
    return out


def job_ranks(threads: pd.DataFrame, thread_rows: pd.DataFrame, env: pd.DataFrame,
              collective_pids: np.ndarray | None = None, *, min_ranks: int = 2) -> pd.DataFrame:
    """RANK_COLUMNS: one row per rank process of the traced tree, sorted by rank; empty
    for a trace of fewer than `min_ranks` (one process, or no job: one trace of a job
    recorded node by node may hold one rank).  A process is a rank when its environment
    names one that its parent's does not (by the same variable) or its parent is a
    launcher (a shell or srun step that passed its own on), and no process below it is a
    rank; without environments, a process with collective-backend threads (or
    `collective_pids`: processes with NCCL calls) is one, numbered in pid order."""
    parent = parents(threads, thread_rows)
    fields = process_fields(env)
    traced = set(int(p) for p in threads["pid"].unique())
    fields = fields[fields["pid"].isin(traced) & (fields["rank"] >= 0)]
    by_pid = {int(r.pid): r for r in fields.itertuples(index=False)}
    mains = threads[threads["tid"] == threads["pid"]]
    launcher = set(mains.loc[mains["comm"].astype(str).str.lower().str.match(LAUNCHER_COMMS).to_numpy(), "pid"].tolist())
    candidates = []
    for pid, row in by_pid.items():
        up = by_pid.get(parent.get(pid, -1))
        if up is not None and up.rank_variable == row.rank_variable and up.rank == row.rank \
                and int(up.pid) not in launcher:
            continue  # it inherited its parent's rank: a worker of that rank (a launcher's child is the rank)
        candidates.append(pid)
    below = {p: _ancestors(p, parent) for p in candidates}
    ranks = [p for p in candidates if not any(p in below[q] for q in candidates if q != p)]
    if ranks:
        rows = [by_pid[p] for p in ranks]
        out = pd.DataFrame({"rank": [r.rank for r in rows], "local_rank": [r.local_rank for r in rows],
                            "world_size": [r.world_size for r in rows], "pid": ranks,
                            "job": [r.job for r in rows], "source": "environment"})
    else:
        comm = threads["comm"].astype(str).str.lower()
        pids = set(threads.loc[comm.str.contains(COLLECTIVE_COMMS).to_numpy(), "pid"].tolist())
        pids |= set(int(p) for p in (collective_pids if collective_pids is not None else ()))
        pids = sorted(pids & traced)
        out = pd.DataFrame({"rank": np.arange(len(pids)), "local_rank": np.full(len(pids), -1),
                            "world_size": np.full(len(pids), len(pids)), "pid": pids,
                            "job": "", "source": "behaviour"})
    if len(out) < max(1, min_ranks):
        return empty_ranks()
    out["trainer_tid"] = [carried_on_by(threads, int(p)) if int(p) in set(threads["tid"].tolist()) else
                          int(threads.loc[threads["pid"] == p, "tid"].min()) for p in out["pid"]]
    out = out.astype({"rank": np.int64, "local_rank": np.int64, "world_size": np.int64, "pid": np.int64,
                      "trainer_tid": np.int64})
    return out.sort_values(["rank", "pid"], kind="stable")[list(RANK_COLUMNS)].reset_index(drop=True)


def _ancestors(pid: int, parent: dict[int, int]) -> set[int]:
    """`pid` and every process above it."""
    seen: set[int] = set()
    while pid in parent and pid not in seen:
        seen.add(pid)
        pid = parent[pid]
    seen.add(pid)
    return seen


def rank_of_threads(threads: pd.DataFrame, thread_rows: pd.DataFrame, ranks: pd.DataFrame) -> np.ndarray:
    """Per row of `threads`, the rank whose process tree holds it (-1: none, e.g. a launcher)."""
    parent = parents(threads, thread_rows)
    rank_by_pid = dict(zip(ranks["pid"].tolist(), ranks["rank"].tolist()))
    memo: dict[int, int] = {}

    def rank_of(pid: int) -> int:
        seen = []
        while pid not in memo and pid not in rank_by_pid and pid in parent and pid not in seen:
            seen.append(pid)
            pid = parent[pid]
        found = memo.get(pid, rank_by_pid.get(pid, -1))
        for p in seen:
            memo[p] = found
        return found

    return np.array([rank_of(int(p)) for p in threads["pid"].tolist()], np.int64)
