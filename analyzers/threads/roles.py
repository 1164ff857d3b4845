"""The thread table: who each traced thread is, how long it was observed, and its role."""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import Span, as_int64
from trainbpf.analyzers.vocab import ROLE_DTYPE
from trainbpf.trace.errors import UsageError

# Roles from thread names, first match wins (comm is at most 15 characters, lower-cased).
# PyTorch names its pin-memory thread "pt_data_pin" and workers "pt_data_worker".
# gloo names its threads "gloo_tcp_loop" and "pt_gloo_runloop" (before "loader": never a
# data loader, though they end the trainer's waits in every collective).
NAME_ROLES: tuple[tuple[str, str], ...] = (
    ("collective", r"gloo|nccl"),
    ("pin_memory", r"pin_memory|pt_data_pin|pin_mem"),
    ("dataloader", r"pt_data_worker|dataloader|data_worker|worker|loader"),
    ("checkpoint", r"checkpoint|ckpt|writer|saver"),
    ("autograd", r"autograd"),
)

# A thread that ends at least this many of the trainer's waits, and this share of them,
# produces what the trainer consumes.
PRODUCER_MIN_WAKEUPS = 5
PRODUCER_MIN_SHARE = 0.2

THREAD_COLUMNS = ("tid", "pid", "comm", "role", "role_source", "first_ns", "last_ns")


def empty_threads() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "tid": np.zeros(0, np.int64),
            "pid": np.zeros(0, np.int64),
            "comm": pd.Series([], dtype=str),
            "role": pd.Series([], dtype=ROLE_DTYPE),
            "role_source": pd.Series([], dtype=str),
            "first_ns": np.zeros(0, np.int64),
            "last_ns": np.zeros(0, np.int64),
        }
    )


def pick_trainer(threads: pd.DataFrame, *, target_pid: int | None, trainer_tid: int | None) -> int | None:
    """The trainer: the named thread, else the target's main thread, else its lowest tid.
    A main thread that exited (pthread_exit) while its process went on hands the role
    to the thread that carried on (carried_on_by)."""
    tids = threads["tid"].to_numpy()
    if trainer_tid is not None:
        if int(trainer_tid) not in set(tids.tolist()):
            raise UsageError(f"--trainer-tid {trainer_tid} is not a thread in this trace")
        return int(trainer_tid)
    if not len(tids):
        return None
    if target_pid is not None:
        if int(target_pid) in set(tids.tolist()):
            return carried_on_by(threads, int(target_pid))
        in_target = tids[threads["pid"].to_numpy() == int(target_pid)]
        if len(in_target):
            return int(in_target.min())
    mains = tids[tids == threads["pid"].to_numpy()]
    return carried_on_by(threads, int(mains.min())) if len(mains) else int(tids.min())


# A process that exits ends all its threads within milliseconds of each other (exit_group:
# the main thread's exit may come first); only a thread that outlived the main thread by
# more than that carried the loop on after a pthread_exit.
CARRIED_ON_MIN_NS = 100_000_000


def carried_on_by(threads: pd.DataFrame, main: int) -> int:
    """`main`, or, where that main thread exited while threads of its process were still
    observed after it, the one of them observed longest after its exit (the oldest
    among equals), leaving out threads named for another role (NAME_ROLES) unless
    all are: it runs the loop now."""
    tid, pid, first, last = (threads[c].to_numpy(np.int64) for c in ("tid", "pid", "first_ns", "last_ns"))
    ended = last[tid == main]
    after = (pid == main) & (tid != main) & (last >= ended[0] + CARRIED_ON_MIN_NS) if len(ended) \
        else np.zeros(len(tid), bool)
    if not after.any():
        return main
    lowered = threads["comm"].astype(str).str.lower()
    helper = lowered.str.contains("|".join(pattern for _, pattern in NAME_ROLES), regex=True).to_numpy()
    if (after & ~helper).any():
        after &= ~helper
    observed = np.where(after, last - np.maximum(first, ended[0]), -1)
    best = np.flatnonzero(observed == observed.max())
    return int(tid[best].min())


def observed_threads(thread_rows: pd.DataFrame, exit_rows: pd.DataFrame, seen: pd.DataFrame, *, span: Span) -> pd.DataFrame:
    """One row per tid (tid, pid, comm, first_ns, last_ns), roles not yet assigned.

    `seen` holds (tid, pid, first_ns) for every tid with activity rows.  A thread is observed
    from its creation (a "thread"/"process" row), else from the trace start if it was seeded
    or named at any time, else from its first activity; until its exit or the trace end."""
    tr = pd.DataFrame(
        {
            "tid": as_int64(thread_rows["tid"]),
            "pid": as_int64(thread_rows["pid"]),
            "ts_ns": as_int64(thread_rows["ts_ns"]),
            "comm": thread_rows["comm"].fillna("").astype(str).to_numpy(dtype=object),
            "name": thread_rows["event"].fillna("").astype(str).to_numpy(dtype=object),
        }
    )
    ex = pd.DataFrame(
        {
            "tid": as_int64(exit_rows["tid"]),
            "pid": as_int64(exit_rows["pid"]),
            "ts_ns": as_int64(exit_rows["ts_ns"]),
            "comm": exit_rows["comm"].fillna("").astype(str).to_numpy(dtype=object),
        }
    )
    sn = pd.DataFrame(
        {"tid": as_int64(seen["tid"]), "pid": as_int64(seen["pid"]), "ts_ns": as_int64(seen["first_ns"])}
    )
    tids = np.unique(np.concatenate([tr["tid"].to_numpy(), ex["tid"].to_numpy(), sn["tid"].to_numpy()]))
    tids = tids[tids >= 0]
    if not len(tids):
        return empty_threads()
    out = pd.DataFrame({"tid": tids})

    newest = tr.sort_values("ts_ns", kind="stable").groupby("tid").last()
    exited = ex.sort_values("ts_ns", kind="stable").groupby("tid").first()
    seen_first = sn.sort_values("ts_ns", kind="stable").groupby("tid").first()
    # Nullable ints through the reindexing: a float round trip would turn ns near 2**63
    # into a value int64 cannot hold.
    created = tr[tr["name"].isin(["thread", "process"])].groupby("tid")["ts_ns"].min().astype("Int64").reindex(tids)

    pid = newest["pid"].reindex(tids)
    pid = pid.fillna(exited["pid"].reindex(tids)).fillna(seen_first["pid"].reindex(tids)).fillna(-1)
    out["pid"] = pid.to_numpy(np.int64)
    comm = newest["comm"].reindex(tids)
    comm = comm.where(comm.fillna("") != "", exited["comm"].reindex(tids)).fillna("")
    out["comm"] = comm.astype(str).to_numpy()

    named = np.isin(tids, tr["tid"].to_numpy())
    first = np.where(named, span.start_ns,
                     seen_first["ts_ns"].astype("Int64").reindex(tids).fillna(span.start_ns).to_numpy(np.int64))
    first = np.where(created.notna().to_numpy(bool), created.fillna(0).to_numpy(np.int64), first)
    first = np.clip(first, span.start_ns, span.end_ns)
    last = exited["ts_ns"].astype("Int64").reindex(tids).fillna(span.end_ns).to_numpy(np.int64)
    last = np.clip(last, first, span.end_ns)
    out["first_ns"] = first.astype(np.int64)
    out["last_ns"] = last.astype(np.int64)
    out["role"] = pd.Categorical(["other"] * len(out), dtype=ROLE_DTYPE)
    out["role_source"] = ""
    return out[list(THREAD_COLUMNS)]


def assign_roles(
    threads: pd.DataFrame,
    *,
    trainer: int | list[int] | None,
    named_by_user: bool = False,
    trainer_wakers: pd.Series | None = None,
    writer_tids: np.ndarray | None = None,
) -> pd.DataFrame:
    """Roles from names, then behaviour: `trainer_wakers` counts, per waker tid, the
    trainer waits it ended (a frequent waker is a producer); `writer_tids` were throttled
    writing dirty pages (a checkpoint writer).  `trainer`: one tid, or a job's ranks' trainers."""
    tids = threads["tid"].to_numpy()
    role = pd.Series("other", index=threads.index, dtype=object)
    source = pd.Series("", index=threads.index, dtype=object)
    lowered = threads["comm"].astype(str).str.lower()
    for name, pattern in reversed(NAME_ROLES):
        hit = lowered.str.contains(pattern, regex=True).to_numpy()
        role[hit] = name
        source[hit] = "name"
    if trainer_wakers is not None and len(trainer_wakers):
        total = float(trainer_wakers.sum())
        wakes = trainer_wakers.reindex(tids).fillna(0).to_numpy()
        producer = (role == "other").to_numpy() & (wakes >= PRODUCER_MIN_WAKEUPS) & (wakes >= PRODUCER_MIN_SHARE * total)
        role[producer] = "dataloader"
        source[producer] = "behaviour"
    if writer_tids is not None and len(writer_tids):
        writer = (role == "other").to_numpy() & np.isin(tids, writer_tids)
        role[writer] = "checkpoint"
        source[writer] = "behaviour"
    if trainer is not None:
        is_trainer = np.isin(tids, np.atleast_1d(np.asarray(trainer, dtype=np.int64)))
        role[is_trainer] = "trainer"
        source[is_trainer] = "option" if named_by_user else "target"
    out = threads.copy()
    out["role"] = pd.Categorical(role.to_numpy(), dtype=ROLE_DTYPE)
    out["role_source"] = source.astype(str).to_numpy()
    return out[list(THREAD_COLUMNS)].reset_index(drop=True)
