"""CUDA frees held back by events: a free of a buffer that its thread made only after
polling an event that was not ready (cudaEventQuery / cuEventQuery returning
cudaErrorNotReady) or making a stream wait on one (cudaStreamWaitEvent /
cuStreamWaitEvent), the way a pipeline keeps a batch until the GPU has finished with it.

- `held_frees(cuda_call, span)`: HELD_COLUMNS, one row per free inside `span` held back
  by an event: of the event calls its thread made since its previous free, the event
  with the most not-ready queries and stream waits, and the stream that event was last
  recorded on before them (cudaEventRecord / cuEventRecord, any thread of the process).
- `held_events(held)`: EVENT_COLUMNS, those frees per (process, thread, event), the
  most frees first.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import Span, as_int64

NOT_READY = 600  # cudaErrorNotReady and CUDA_ERROR_NOT_READY alike
QUERIES = ("cudaEventQuery", "cuEventQuery")
STREAM_WAITS = ("cudaStreamWaitEvent", "cuStreamWaitEvent")
RECORDS = ("cudaEventRecord", "cuEventRecord")
HOST_FREES = ("cudaFreeHost", "cuMemFreeHost")

HELD_COLUMNS = (
    "pid", "tid",
    "free_ns",  # the free's start
    "addr",  # the pointer freed
    "memory",  # lifetimes.MEMORY: "cuda_host" (pinned host memory) or "cuda_device"
    "event",  # the event that held it back
    "stream",  # the stream the event was last recorded on before it was waited for (0: no record seen)
    "queries",  # not-ready queries of the event by the thread before the free
    "waits",  # stream waits on the event by the thread before the free
    "first_ns",  # the first of them
)
EVENT_COLUMNS = ("pid", "tid", "event", "stream", "frees", "queries", "waits", "held_ms", "memory")


def _empty(columns: tuple[str, ...]) -> pd.DataFrame:
    return pd.DataFrame({c: np.zeros(0, object if c == "memory" else np.float64 if c == "held_ms" else np.int64)
                         for c in columns})


def _calls(cuda_call: pd.DataFrame) -> pd.DataFrame:
    """The calls' columns this needs, the runtime's own (a driver call inside a runtime
    call is the runtime call's)."""
    c = pd.DataFrame({
        "pid": as_int64(cuda_call["pid"]), "tid": as_int64(cuda_call["tid"]), "ts": as_int64(cuda_call["ts_ns"], 0),
        "name": cuda_call["name"].astype(str).to_numpy(), "state": cuda_call["state"].astype(str).to_numpy(),
        "addr": as_int64(cuda_call["addr"], 0), "ret": as_int64(cuda_call["ret"], -1),
        "stream": as_int64(cuda_call["stream"], 0) if "stream" in cuda_call else 0,
        "nested": as_int64(cuda_call["nested"], 0)})
    return c[c["nested"].to_numpy() == 0]


def _markers(c: pd.DataFrame, frees: pd.DataFrame) -> pd.DataFrame:
    """Not-ready queries and stream waits, each with the free its thread made next
    (`free`: a row label of `frees`; markers after a thread's last free left out)."""
    query = np.isin(c["name"].to_numpy(), QUERIES) & (c["ret"].to_numpy() == NOT_READY)
    wait = np.isin(c["name"].to_numpy(), STREAM_WAITS) & (c["ret"].to_numpy() == 0)
    m = c[query | wait].assign(query=query[query | wait])
    if not len(m):
        return m.assign(free=np.zeros(0, np.int64))
    m = m.sort_values("ts", kind="stable")
    nxt = pd.merge_asof(m, frees[["pid", "tid", "ts"]].assign(free=frees.index.to_numpy(np.int64), free_ts=frees["ts"]),
                        on="ts", by=["pid", "tid"], direction="forward", allow_exact_matches=True)
    return nxt[nxt["free"].notna()].astype({"free": np.int64})


def held_frees(cuda_call: pd.DataFrame | None, span: Span) -> pd.DataFrame:
    """HELD_COLUMNS, one row per successful free inside `span` that its thread made after
    not-ready queries of, or stream waits on, an event since its previous free; ordered
    by time."""
    if cuda_call is None or not len(cuda_call):
        return _empty(HELD_COLUMNS)
    c = _calls(cuda_call)
    is_free = (c["state"].to_numpy() == "free") & (c["ret"].to_numpy() == 0)
    frees = c[is_free].sort_values("ts", kind="stable").reset_index(drop=True)
    m = _markers(c, frees)
    if not len(m):
        return _empty(HELD_COLUMNS)
    per = m.groupby(["free", "addr"]).agg(queries=("query", "sum"), marks=("query", "size"), first_ns=("ts", "min"))
    per = per.assign(waits=per["marks"] - per["queries"]).reset_index()
    # The event with the most marks before each free (the earliest on a tie).
    per = per.sort_values(["free", "marks", "first_ns"], ascending=[True, False, True], kind="stable")
    per = per.drop_duplicates("free").rename(columns={"addr": "event"})
    f = frees.loc[per["free"].to_numpy()]
    out = pd.DataFrame({
        "pid": f["pid"].to_numpy(), "tid": f["tid"].to_numpy(), "free_ns": f["ts"].to_numpy(),
        "addr": f["addr"].to_numpy(),
        "memory": np.where(np.isin(f["name"].to_numpy(), HOST_FREES), "cuda_host", "cuda_device").astype(object),
        "event": per["event"].to_numpy(np.int64), "queries": per["queries"].to_numpy(np.int64),
        "waits": per["waits"].to_numpy(np.int64), "first_ns": per["first_ns"].to_numpy(np.int64)})
    out = out[(out["free_ns"] >= span.start_ns) & (out["free_ns"] < span.end_ns)]
    return _with_streams(out, c).sort_values("free_ns", kind="stable", ignore_index=True)[list(HELD_COLUMNS)]


def _with_streams(held: pd.DataFrame, c: pd.DataFrame) -> pd.DataFrame:
    """`held` with the stream each event was last recorded on at or before its first
    not-ready query or wait (0: no record seen)."""
    records = c[np.isin(c["name"].to_numpy(), RECORDS)]
    records = records[["pid", "addr", "ts", "stream"]].rename(columns={"addr": "event"}).sort_values("ts")
    if not len(held) or not len(records):
        return held.assign(stream=np.zeros(len(held), np.int64))
    joined = pd.merge_asof(held.sort_values("first_ns").assign(ts=lambda d: d["first_ns"]), records, on="ts",
                           by=["pid", "event"], direction="backward")
    return joined.drop(columns="ts").assign(stream=joined["stream"].fillna(0).astype(np.int64))


def held_events(held: pd.DataFrame) -> pd.DataFrame:
    """EVENT_COLUMNS: the held frees per (pid, tid, event), the stream its last free's
    record named, held_ms the median from the first not-ready query or wait to the
    free; the most frees first."""
    if not len(held):
        return _empty(EVENT_COLUMNS)
    h = held.assign(held_ms=(held["free_ns"] - held["first_ns"]) / 1e6)
    g = h.groupby(["pid", "tid", "event"], sort=False)
    out = g.agg(stream=("stream", "last"), frees=("free_ns", "size"), queries=("queries", "sum"),
                waits=("waits", "sum"), held_ms=("held_ms", "median"), memory=("memory", "last")).reset_index()
    out = out.sort_values(["frees", "queries"], ascending=False, kind="stable", ignore_index=True)
    return out[list(EVENT_COLUMNS)]
