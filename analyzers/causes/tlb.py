"""TLB shootdowns: which threads' mapping changes interrupted the trainer.

The `tlb_flush` rows count, per 100 ms bucket and thread, the flush IPIs a thread sent
(it unmapped or madvised memory other CPUs of its process may cache) and the ones that
interrupted it (docs/trace-format.md).  A shootdown reaches only CPUs running the same
address space, so the sender of one the trainer received is a thread of the trainer's
process (or a kernel thread working on its memory: khugepaged, NUMA balancing, not
counted).  Each bucket's received shootdowns are charged to that process's senders of
the bucket in proportion to what each sent; the rest, with no sender in the bucket, to
nobody (`unmatched`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import Span, as_int64

# One row per (receiving thread, sending thread): the shootdowns charged.
CHARGE_COLUMNS = ("tid", "sender_tid", "pid", "shootdowns")
# One row per (thread, mm syscall): its calls in the window.
CALL_COLUMNS = ("tid", "syscall", "calls")
# Senders a finding names at most.
MAX_SENDERS = 5


def _sides(tlb_flush: pd.DataFrame, window: Span) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The window's sent and received counts, each (bucket start, tid, pid, flushes)."""
    if not len(tlb_flush):
        empty = pd.DataFrame({c: np.zeros(0, np.int64) for c in ("ts_ns", "tid", "pid", "flushes")})
        return empty, empty
    ts = as_int64(tlb_flush["ts_ns"])
    frame = pd.DataFrame({"ts_ns": ts, "tid": as_int64(tlb_flush["tid"]), "pid": as_int64(tlb_flush["pid"]),
                          "flushes": as_int64(tlb_flush["flushes"], 0)})
    frame = frame[(ts >= window.start_ns) & (ts < window.end_ns)]
    side = tlb_flush["side"].astype(object).to_numpy()[(ts >= window.start_ns) & (ts < window.end_ns)]
    return frame[side == "sent"], frame[side == "received"]


def shootdown_charges(tlb_flush: pd.DataFrame, window: Span) -> pd.DataFrame:
    """CHARGE_COLUMNS: each thread's received shootdowns in the window, charged to the
    senders of its process in the same bucket (sender_tid -1: none sent in it)."""
    sent, received = _sides(tlb_flush, window)
    if not len(received):
        return pd.DataFrame({c: np.zeros(0, np.int64) for c in CHARGE_COLUMNS})
    pair = received.merge(sent, on=["ts_ns", "pid"], how="left", suffixes=("", "_sent"))
    own = (pair["tid_sent"] == pair["tid"]).to_numpy()  # a thread never interrupts itself: no sender
    pair.loc[own, ["tid_sent", "flushes_sent"]] = np.nan
    total = pair.groupby(["ts_ns", "tid"])["flushes_sent"].transform("sum")
    share = np.where(total > 0, pair["flushes_sent"].fillna(0) / total.where(total > 0, 1), 1.0)
    charged = pd.DataFrame({"tid": pair["tid"].to_numpy(np.int64),
                            "sender_tid": pair["tid_sent"].fillna(-1).to_numpy(np.int64),
                            "pid": pair["pid"].to_numpy(np.int64), "shootdowns": pair["flushes"].to_numpy() * share})
    out = charged.groupby(["tid", "sender_tid", "pid"], as_index=False)["shootdowns"].sum()
    out = out[out["shootdowns"] > 0]
    out["shootdowns"] = np.round(out["shootdowns"].to_numpy()).astype(np.int64)
    return out.sort_values(["tid", "shootdowns"], ascending=[True, False], kind="stable")[list(CHARGE_COLUMNS)]


def mm_call_counts(mm_syscall: pd.DataFrame, window: Span) -> pd.DataFrame:
    """CALL_COLUMNS of the `mm_syscall` rows (meaningful names) starting in the window."""
    if not len(mm_syscall):
        return pd.DataFrame({"tid": np.zeros(0, np.int64), "syscall": pd.Series(dtype=object),
                             "calls": np.zeros(0, np.int64)})
    ts = as_int64(mm_syscall["ts_ns"])
    rows = pd.DataFrame({"tid": as_int64(mm_syscall["tid"]), "syscall": mm_syscall["syscall"].astype(str).to_numpy()})
    rows = rows[(ts >= window.start_ns) & (ts < window.end_ns)]
    return rows.groupby(["tid", "syscall"], as_index=False).size().rename(columns={"size": "calls"})[list(CALL_COLUMNS)]


def shootdown_evidence(charges: pd.DataFrame, tids: list[int], names: dict[int, str],
                       mm_calls: pd.DataFrame) -> dict[str, Any]:
    """What a memory finding says of the shootdowns the threads `tids` received: how
    many, and the threads whose unmaps sent them (`senders`: tid, comm, shootdowns and
    the mm calls that thread made in the window, by syscall: `mm_calls`, CALL_COLUMNS);
    {} when none."""
    mine = charges[charges["tid"].isin(tids)]
    if not len(mine) or not int(mine["shootdowns"].sum()):
        return {}
    by_sender = mine.groupby("sender_tid")["shootdowns"].sum().sort_values(ascending=False, kind="stable")
    senders = []
    for tid, count in by_sender.items():
        if tid < 0 or not count or len(senders) == MAX_SENDERS:
            continue
        calls = mm_calls[mm_calls["tid"] == tid].sort_values("calls", ascending=False, kind="stable")
        senders.append({"tid": int(tid), "pid": int(mine.loc[mine["sender_tid"] == tid, "pid"].iloc[0]),
                        "comm": names.get(int(tid), ""), "shootdowns": int(count),
                        "mm_calls": {str(k): int(v) for k, v in zip(calls["syscall"], calls["calls"])}})
    return {"tlb_shootdowns": {"received": int(mine["shootdowns"].sum()),
                               "unmatched": int(by_sender.get(-1, 0)), "senders": senders}}
