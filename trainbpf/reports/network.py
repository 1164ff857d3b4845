"""A network finding's culprits (its evidence's `network`, analyzers/causes/network.py):
the peers its threads waited on and the uploads that shared their interface; and the
peers' host names, looked up only when asked (`trainbpf analyze --resolve`)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any, Callable

# An uploader is named from this share of what was sent on the interface during the waits.
MIN_UPLOAD_SHARE = 0.05
# Reverse lookups of one report share this many seconds; a lookup not done by then
# leaves the address.
RESOLVE_TIMEOUT_S = 2.0


def network_culprits(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """{kind: "peer"} per peer waited on, with its seconds, bytes, requests, mean latency
    and retransmits; {kind: "thread"/"process", uploader: true} per task that sent on the
    victims' interfaces during the waits, with its bytes and rate."""
    net = evidence.get("network")
    if not net:
        return []
    out: list[dict[str, Any]] = []
    for p in net["peers"]:
        if p["seconds"] <= 0:
            continue
        out.append({"kind": "peer", "name": p["peer"], "seconds": round(float(p["seconds"]), 6),
                    "recv_bytes": int(p["recv_bytes"]), "send_bytes": int(p["send_bytes"]),
                    "requests": int(p["requests"]), "mean_latency_ms": round(float(p["mean_latency_ms"]), 3),
                    "retransmits": int(p["retransmits"]), "interface": p["interface"], "family": p["family"]})
    for u in net["uploaders"]:
        if u["bytes"] >= MIN_UPLOAD_SHARE * max(float(net["sent_bytes"]), float(u["bytes"])):
            out.append({"kind": "thread" if u["traced"] else "process", "name": u["comm"] or "?", "tid": int(u["tid"]),
                        "pid": u["pid"], "bytes": int(u["bytes"]), "rate_bytes_per_s": round(float(u["rate_bytes_per_s"]), 3),
                        "uploader": True, "interface": "/".join(net["interfaces"])})
    return out


def thread_network(traffic: Any) -> dict[int, dict[str, int]]:
    """tid -> {"recv_bytes", "send_bytes"} of each thread that moved bytes over sockets
    (network.TRAFFIC_COLUMNS rows; None: none)."""
    if traffic is None or not len(traffic):
        return {}
    return {int(r.tid): {"recv_bytes": int(r.recv_bytes), "send_bytes": int(r.send_bytes)}
            for r in traffic.itertuples(index=False)}


def _address(peer: str) -> str | None:
    """The IP address of an "ip:port" or "[ipv6]:port" peer; None for anything else (a
    UNIX socket's path, a socket by its inode)."""
    host = peer[1:peer.find("]")] if peer.startswith("[") and "]" in peer else peer.rsplit(":", 1)[0]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def resolve_peers(doc: dict[str, Any], *, lookup: Callable[[str], Any] | None = None,
                  timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """Add `host` (the reverse DNS name; `lookup`, default socket.gethostbyaddr) to the
    report's peer culprits, in place.  All lookups together take at most `timeout_s`; a
    failed or late one leaves the address."""
    peers = [c for f in doc.get("findings") or [] for c in f.get("culprits") or [] if c.get("kind") == "peer"]
    addresses = sorted({a for a in (_address(str(c["name"])) for c in peers) if a})
    if not addresses:
        return
    answers: dict[str, str] = {}
    lookup = lookup or socket.gethostbyaddr

    def look(address: str) -> None:
        try:
            answers[address] = str(lookup(address)[0])
        except (OSError, UnicodeError):
            pass  # no name: the address stays

    # Daemon threads: a lookup the resolver never answers must not hold the exit.
    threads = [threading.Thread(target=look, args=(a,), daemon=True) for a in addresses]
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    names = dict(answers)  # late answers no longer count
    for c in peers:
        host = names.get(_address(str(c["name"])) or "")
        if host:
            c["host"] = host
