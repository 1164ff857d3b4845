"""Network waits (docs/findings.md, "Network culprits"): which poll waits were waits on
a socket, how many bytes each thread moved over sockets, and, for a network_io finding,
the peers its threads waited on and the upload that competed with them.

The recorder counts socket traffic per bucket in the kernel (`net_io`, `net_request`,
`retransmit`, the machine's `net_device`) and names each socket once (`socket`).  A wait
is matched to the sockets its thread received on in the buckets it overlaps, or in the
next (the data that ended it is counted when the receive returns): its seconds are
split among them by the bytes received there.  A peer's bytes, requests, latency and
retransmits are its profile over the analysed window.  The upload that competes is what
others sent on the interfaces of the victims' sockets during the waits: job threads
from their own `net_io` send rows, other processes from `net_device`'s transmissions.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.files import kind_rows
from trainbpf.analyzers.intervals import NS_PER_S, as_int64, intersect, merge_intervals

# The kinds it reads (trace views, trainbpf.trace.schema.KIND_NAMES).
NET_KINDS = ("socket", "net_io", "net_request", "retransmit", "net_device")
# Others' transmissions below this share of an interface's during the waits (and below
# UPLOAD_MIN_BYTES) compete with nothing worth naming.
UPLOAD_MIN_SHARE = 0.25
UPLOAD_MIN_BYTES = 1 << 20
# Peers and uploaders named at most.
MAX_NAMED = 5

PEER_COLUMNS = ("peer", "family", "protocol", "interface", "seconds", "recv_bytes", "send_bytes", "requests",
                "mean_latency_ms", "max_latency_ms", "retransmits")
TRAFFIC_COLUMNS = ("tid", "recv_bytes", "send_bytes")


def _recv_rows(net_io: pd.DataFrame) -> pd.DataFrame:
    if not len(net_io):
        return net_io
    return net_io[(net_io["direction"].astype(str) == "recv").to_numpy() & (as_int64(net_io["bytes"], 0) > 0)]


def _near(rows_ts: np.ndarray, bucket_ns: int, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per wait [start, end), the range [lo, hi) of the sorted bucket starts `rows_ts`
    whose bucket overlaps the wait or starts in the bucket after its end."""
    lo = np.searchsorted(rows_ts, start - bucket_ns, side="right")
    hi = np.searchsorted(rows_ts, end + bucket_ns, side="left")
    return lo, np.maximum(hi, lo)


# Families whose traffic makes a poll wait a network wait.  A UNIX socket's peer is on
# this machine: a DataLoader's workers hand over shared-memory descriptors through one,
# while the trainer polls its result pipe.
NETWORK_FAMILIES = ("ipv4", "ipv6")


def waits_on_network(tid: np.ndarray, start: np.ndarray, end: np.ndarray, net_io: pd.DataFrame | None,
                     socket: pd.DataFrame | None = None) -> np.ndarray:
    """Per wait (tid, start_ns, end_ns) of a poll/select/epoll stack, whether its thread
    received on an IP socket (NETWORK_FAMILIES, by the `socket` rows) in a bucket the
    wait overlaps or in the next one."""
    out = np.zeros(len(tid), dtype=bool)
    recv = _recv_rows(net_io if net_io is not None else pd.DataFrame())
    if len(recv):
        ip = sockets({"socket": socket if socket is not None else pd.DataFrame()})
        ip = ip[ip["family"].astype(str).isin(NETWORK_FAMILIES).to_numpy()]
        recv = recv[np.isin(as_int64(recv["socket"], -1), as_int64(ip["socket"], -1))]
    if not len(recv) or not len(tid):
        return out
    rtid, rts = as_int64(recv["tid"]), as_int64(recv["ts_ns"], 0)
    bucket = int(max(1, as_int64(recv["dur_ns"], 0).max()))
    for t in np.unique(tid):
        mine = np.sort(rts[rtid == t])
        at = np.flatnonzero(tid == t)
        lo, hi = _near(mine, bucket, start[at], end[at])
        out[at] = hi > lo
    return out


def thread_traffic(net_io: pd.DataFrame, start_ns: int, end_ns: int) -> pd.DataFrame:
    """Bytes each thread received and sent over sockets in buckets starting inside
    [start_ns, end_ns) (TRAFFIC_COLUMNS); empty without net_io rows."""
    if not len(net_io):
        return pd.DataFrame({c: np.zeros(0, np.int64) for c in TRAFFIC_COLUMNS})
    ts = as_int64(net_io["ts_ns"], 0)
    rows = net_io[(ts >= start_ns) & (ts < end_ns)]
    direction = rows["direction"].astype(str).to_numpy()
    size = as_int64(rows["bytes"], 0)
    per = pd.DataFrame({"tid": as_int64(rows["tid"]), "recv_bytes": np.where(direction == "recv", size, 0),
                        "send_bytes": np.where(direction == "send", size, 0)}).groupby("tid", sort=True).sum()
    return per.reset_index()[list(TRAFFIC_COLUMNS)]


def _inside(frame: pd.DataFrame, ws: np.ndarray, we: np.ndarray) -> np.ndarray:
    """Per bucketed row, the share of its bucket inside the disjoint sorted windows."""
    if not len(frame):
        return np.zeros(0)
    start = as_int64(frame["ts_ns"], 0)
    end = start + np.maximum(as_int64(frame["dur_ns"], 0), 1)
    row, _, s, e = intersect(start, end, ws, we)
    return np.bincount(row, weights=(e - s).astype(np.float64), minlength=len(frame)) / (end - start)


def sockets(frames: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per socket inode (socket, peer, family, protocol, interface): its last
    `socket` row, a peer read again after a connect replacing the first."""
    rows = kind_rows(frames, "socket")
    if not len(rows):
        return pd.DataFrame(columns=["socket", "peer", "family", "protocol", "interface"])
    out = pd.DataFrame({"socket": as_int64(rows["socket"], 0), "ts": as_int64(rows["ts_ns"], 0),
                        "peer": rows["peer"].fillna("").astype(str).to_numpy(),
                        "family": rows["family"].fillna("").astype(str).to_numpy(),
                        "protocol": as_int64(rows["protocol"], 0),
                        "interface": rows["interface"].fillna("").astype(str).to_numpy()})
    out = out.sort_values(["socket", "ts"], kind="stable").drop_duplicates("socket", keep="last")
    return out.drop(columns="ts").reset_index(drop=True)


def peer_name(peer: str, family: str, socket: int) -> str:
    """What a person reads for a socket's peer: its address, a UNIX socket by its path,
    an unnamed one (or one the recorder never named) by its inode."""
    if peer:
        return f"unix:{peer}" if family == "unix" else peer
    return f"unix socket {socket} (unnamed)" if family == "unix" else f"socket {socket}"


def _waited_seconds(pieces: pd.DataFrame, recv: pd.DataFrame) -> tuple[pd.Series, float]:
    """Seconds of the pieces per socket (each piece split by the bytes its thread received
    on each socket near it), and the seconds matched to no socket."""
    per: dict[int, float] = {}
    unmatched = 0.0
    rtid = as_int64(recv["tid"]) if len(recv) else np.zeros(0, np.int64)
    bucket = int(max(1, as_int64(recv["dur_ns"], 0).max())) if len(recv) else 1
    for tid, group in pieces.groupby("root_tid", sort=False):
        mine = recv[rtid == int(tid)]
        order = np.argsort(as_int64(mine["ts_ns"], 0), kind="stable")
        ts = as_int64(mine["ts_ns"], 0)[order]
        sock, size = as_int64(mine["socket"], 0)[order], as_int64(mine["bytes"], 0)[order].astype(np.float64)
        ns = group["ns"].to_numpy(np.float64)
        lo, hi = _near(ts, bucket, group["start_ns"].to_numpy(np.int64), group["end_ns"].to_numpy(np.int64))
        counts = hi - lo
        unmatched += float(ns[counts == 0].sum())
        piece = np.repeat(np.arange(len(ns)), counts)
        row = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo, counts)
        total = np.bincount(piece, weights=size[row], minlength=len(ns))
        share = ns[piece] * size[row] / np.maximum(total[piece], 1.0)
        for s, v in pd.Series(share).groupby(sock[row]).sum().items():
            per[int(s)] = per.get(int(s), 0.0) + float(v)
    return pd.Series(per, dtype=np.float64) / NS_PER_S, unmatched / NS_PER_S


def _in_window(ctx: Any, kind: str) -> pd.DataFrame:
    rows = kind_rows(ctx.frames, kind)
    if not len(rows):
        return rows
    ts = as_int64(rows["ts_ns"], 0)
    return rows[(ts >= ctx.window.start_ns) & (ts < ctx.window.end_ns)]


def _sum_by_socket(rows: pd.DataFrame, column: str) -> pd.Series:
    if not len(rows):
        return pd.Series(dtype=np.float64)
    return pd.Series(as_int64(rows[column], 0).astype(np.float64)).groupby(as_int64(rows["socket"], 0)).sum()


def peers(ctx: Any, pieces: pd.DataFrame, roots: list[int]) -> tuple[pd.DataFrame, float]:
    """The peers the `roots` threads waited on (PEER_COLUMNS), most seconds first, and the
    seconds matched to no socket."""
    io = kind_rows(ctx.frames, "net_io")
    mine = io[np.isin(as_int64(io["tid"]), roots)] if len(io) else io
    seconds, unmatched = _waited_seconds(pieces, _recv_rows(mine))
    named = sockets(ctx.frames).set_index("socket")
    window = _in_window(ctx, "net_io")
    window = window[np.isin(as_int64(window["tid"]), roots)] if len(window) else window
    direction = window["direction"].astype(str).to_numpy() if len(window) else np.zeros(0, object)
    requests = _in_window(ctx, "net_request")
    requests = requests[np.isin(as_int64(requests["tid"]), roots)] if len(requests) else requests
    per = pd.DataFrame({
        "seconds": seconds,
        "recv_bytes": _sum_by_socket(window[direction == "recv"], "bytes"),
        "send_bytes": _sum_by_socket(window[direction == "send"], "bytes"),
        "requests": _sum_by_socket(requests, "requests"),
        "latency_ns": _sum_by_socket(requests, "latency_ns"),
        "max_latency_ns": requests.groupby(as_int64(requests["socket"], 0))["max_latency_ns"].max()
        if len(requests) else pd.Series(dtype=np.float64),
        "retransmits": _sum_by_socket(_in_window(ctx, "retransmit"), "retransmits"),
    }).reindex(seconds.index).fillna(0.0)  # the sockets waited on
    if not len(per):
        return pd.DataFrame(columns=list(PEER_COLUMNS)), unmatched
    info = named.reindex(per.index)
    per["family"] = info["family"].fillna("").astype(str).to_numpy()
    per["protocol"] = info["protocol"].fillna(0).astype(np.int64).to_numpy()
    per["interface"] = info["interface"].fillna("").astype(str).to_numpy()
    per["peer"] = [peer_name(str(p) if isinstance(p, str) else "", f, int(s))
                   for s, p, f in zip(per.index, info["peer"], per["family"])]
    g = per.groupby("peer", sort=False).agg(
        family=("family", "first"), protocol=("protocol", "first"), interface=("interface", "first"),
        seconds=("seconds", "sum"), recv_bytes=("recv_bytes", "sum"), send_bytes=("send_bytes", "sum"),
        requests=("requests", "sum"), latency_ns=("latency_ns", "sum"), max_latency_ns=("max_latency_ns", "max"),
        retransmits=("retransmits", "sum")).reset_index()
    g["mean_latency_ms"] = g["latency_ns"] / np.maximum(g["requests"], 1) / 1e6
    g["max_latency_ms"] = g["max_latency_ns"] / 1e6
    g = g.sort_values("seconds", ascending=False, kind="stable").reset_index(drop=True)
    return g[list(PEER_COLUMNS)], unmatched


def uploaders(ctx: Any, interfaces: list[str], roots: list[int], ws: np.ndarray, we: np.ndarray
              ) -> tuple[list[dict[str, Any]], float]:
    """Who else sent on `interfaces` (every interface when none is known) during the
    waits, most bytes first: job threads from their net_io send rows on sockets routed
    there, other tasks from net_device transmissions; and every byte sent there then."""
    waited_s = float((we - ws).sum()) / NS_PER_S
    traced = set(int(t) for t in ctx.threads["tid"]) if len(ctx.threads) else set()
    routed = sockets(ctx.frames)
    if interfaces:
        routed = routed[routed["interface"].isin(interfaces)]
    io = kind_rows(ctx.frames, "net_io")
    per: dict[tuple[int, int | None, str, bool], float] = {}
    sent = 0.0
    if len(io):
        send = io[(io["direction"].astype(str) == "send").to_numpy()
                  & np.isin(as_int64(io["socket"], 0), routed["socket"].to_numpy(np.int64))]
        weighted = _inside(send, ws, we) * as_int64(send["bytes"], 0)
        sent = float(weighted.sum())
        for (tid, pid), b in pd.Series(weighted).groupby([as_int64(send["tid"]), as_int64(send["pid"], -1)]).sum().items():
            if int(tid) not in roots and b > 0:
                per[(int(tid), int(pid), ctx.thread(int(tid))["comm"], True)] = float(b)
    device = kind_rows(ctx.frames, "net_device")
    if len(device):
        xmit = device[(device["direction"].astype(str) == "xmit").to_numpy()]
        if interfaces:
            xmit = xmit[xmit["interface"].astype(str).isin(interfaces).to_numpy()]
        weighted = _inside(xmit, ws, we) * as_int64(xmit["bytes"], 0)
        sent = max(sent, float(weighted.sum()))
        tids, pids = as_int64(xmit["tid"], 0), as_int64(xmit["pid"], -1)
        comms = xmit["comm"].fillna("").astype(str).to_numpy()
        for (tid, pid, comm), b in pd.Series(weighted).groupby([tids, pids, comms]).sum().items():
            if int(tid) != 0 and int(tid) not in traced and b > 0:
                per[(int(tid), int(pid), str(comm), False)] = float(b)
    out = [{"tid": tid, "pid": pid if pid >= 0 else None, "comm": comm, "traced": own, "bytes": b,
            "rate_bytes_per_s": b / waited_s if waited_s > 0 else 0.0}
           for (tid, pid, comm, own), b in sorted(per.items(), key=lambda kv: -kv[1])]
    return out[:MAX_NAMED], sent


def network_culprits(ctx: Any, pieces: pd.DataFrame, roots: list[int]) -> dict[str, Any]:
    """The `network` evidence of a network_io finding whose `pieces`
    (findings.ATTRIBUTED_COLUMNS) ended in socket waits of threads `roots`: the peers
    waited on and the uploaders on their interfaces, with its `case` ("upload" where
    another sender filled the interface, "slow_peer" where the peer's answers took the
    time) and `names`; {} without net_io rows (an older recorder)."""
    if not len(kind_rows(ctx.frames, "net_io")) or not len(pieces):
        return {}
    roots = [int(r) for r in roots]
    ws, we = merge_intervals(pieces["start_ns"].to_numpy(np.int64), pieces["end_ns"].to_numpy(np.int64))
    found, unmatched = peers(ctx, pieces, roots)
    interfaces = sorted({str(i) for i in found["interface"] if i})
    senders, sent = uploaders(ctx, interfaces, roots, ws, we)
    network = {"peers": found.head(MAX_NAMED).to_dict("records"), "unmatched_s": unmatched,
               "interfaces": interfaces, "uploaders": senders, "sent_bytes": sent,
               "waited_s": float((we - ws).sum()) / NS_PER_S}
    return {"network": network, **_case(found, senders, sent, interfaces)}


def _case(found: pd.DataFrame, senders: list[dict[str, Any]], sent: float, interfaces: list[str]) -> dict[str, Any]:
    """The evidence's `case` and `names` (analyzers/causes/categories.py, network_io)."""
    peer = str(found["peer"].iloc[0]) if len(found) else "the peer"
    top = senders[0] if senders else None
    if top and top["bytes"] >= UPLOAD_MIN_BYTES and top["bytes"] >= UPLOAD_MIN_SHARE * max(sent, top["bytes"]):
        return {"case": "upload", "names": {
            "peer": peer, "interface": "/".join(interfaces) or "the interface",
            "uploader": f"{top['comm'] or '?'} ({top['tid']})", "uploader_name": top["comm"] or "the uploader",
            "uploaded_bytes": top["bytes"], "rate_bytes": top["rate_bytes_per_s"]}}
    if len(found) and found["requests"].iloc[0] > 0:
        first = found.iloc[0]
        return {"case": "slow_peer", "names": {
            "peer": peer, "requests": int(first["requests"]), "latency_ms": float(first["mean_latency_ms"]),
            "max_latency_ms": float(first["max_latency_ms"])}}
    return {}
