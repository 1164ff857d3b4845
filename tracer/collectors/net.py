"""Collector for probes/net.bpf.c: the sockets traced threads used (`socket` rows), their
bytes, calls and answered requests (`net_io`, `net_request`), the retransmits of those
sockets (`retransmit`) and every interface's packets (`net_device`), counted in the
kernel per bucket of net_bucket_ns."""

from __future__ import annotations

import ipaddress
import os
import socket as socketlib
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.bucketed import BucketCounts, bucket_span, issuers
from trainbpf.tracer.collector import Collector, cstrings
from trainbpf.tracer.kernel_btf import field_offsets

DIRECTIONS = ("recv", "send")  # the probe's NET_RECV, NET_SEND codes, in order
DEVICE_DIRECTIONS = ("recv", "xmit")  # net_device's names of the same codes
# Keys one flush can hold in each count hash: ten 100 ms buckets of a few hundred
# (thread, socket, direction) or (interface, task, direction); past it, counted as lost.
NET_ENTRIES = 16384
NET_SOCKETS = 16384  # sockets (and threads' unanswered sends) remembered, the least recent forgotten
FAMILIES = {socketlib.AF_UNIX: "unix", socketlib.AF_INET: "ipv4", socketlib.AF_INET6: "ipv6"}
# The struct fields the probe follows (its OFF_* defines), found in the kernel's BTF.
KERNEL_FIELDS = {
    "OFF_SKC_DADDR": ("sock", "__sk_common.skc_daddr"),
    "OFF_SKC_DPORT": ("sock", "__sk_common.skc_dport"),
    "OFF_SKC_V6_DADDR": ("sock", "__sk_common.skc_v6_daddr"),
    "OFF_SKC_BOUND_DEV_IF": ("sock", "__sk_common.skc_bound_dev_if"),
    "OFF_SK_SOCKET": ("sock", "sk_socket"),
    "OFF_SK_DST_CACHE": ("sock", "sk_dst_cache"),
    "OFF_SOCKET_FILE": ("socket", "file"),
    "OFF_FILE_INODE": ("file", "f_inode"),
    "OFF_INODE_INO": ("inode", "i_ino"),
    "OFF_DST_DEV": ("dst_entry", "dev"),
    "OFF_NETDEV_NAME": ("net_device", "name"),
    "OFF_UNIX_PEER": ("unix_sock", "peer"),
    "OFF_UNIX_ADDR": ("unix_sock", "addr"),
    "OFF_UNIX_ADDRESS_LEN": ("unix_address", "len"),
    "OFF_UNIX_ADDRESS_PATH": ("unix_address", "name.sun_path"),
}


class NetCollector(Collector):
    name = "net"
    source = "net.bpf.c"
    tracepoints = ("sock:sock_recv_length", "sock:sock_send_length", "tcp:tcp_retransmit_skb",
                   "net:net_dev_xmit", "net:netif_receive_skb")
    ringbufs = ("net_events",)

    def __init__(self, settings):
        super().__init__(settings)
        width = settings.net_bucket_ns
        self.io = BucketCounts("net_counts", width, ("bucket", "tid", "ino", "direction"),
                               ("bytes", "calls", "requests", "latency"), max_fields=("max_latency",))
        self.retransmits = BucketCounts("retransmit_counts", width, ("bucket", "ino"), ("count",), task=False)
        self.devices = BucketCounts("device_counts", width, ("bucket", "ifname", "direction", "tid"),
                                    ("bytes", "packets"))
        self.visible: Callable[[int], bool] | None = None  # under sudo: whose tasks may be named

    def defines(self) -> dict[str, int]:
        offsets = field_offsets(KERNEL_FIELDS)
        return {"NET_ENTRIES": NET_ENTRIES, "NET_SOCKETS": NET_SOCKETS, "NET_RECV": 0, "NET_SEND": 1,
                "NET_OFFSETS": int(offsets is not None), **(offsets or dict.fromkeys(KERNEL_FIELDS, 0))}

    def open(self, session) -> None:
        super().open(session)
        if session.gate is not None:
            self.visible = session.gate.sees

    def decode(self, ringbuf: str, r: np.ndarray) -> list[pa.RecordBatch]:
        interfaces = cstrings(r["interface"])
        return [make_batch("socket", {
            "ts_ns": r["ts_ns"].astype(np.int64),
            "tid": r["tid"].astype(np.int32),
            "pid": r["pid"].astype(np.int32),
            "socket": r["socket"].astype(np.uint64),
            "family": [FAMILIES.get(int(f), "other") for f in r["family"]],
            "peer": [peer_name(int(f), bytes(a), int(n), int(p)) for f, a, n, p in
                     zip(r["family"], r["addr"], r["addr_len"], r["port"])],
            "protocol": r["protocol"].astype(np.int32),
            "interface": [name or interface_name(int(i), int(pid)) for name, i, pid in
                          zip(interfaces, r["ifindex"], r["pid"])],
        })]

    def drain(self, bpf, now_ns: int, *, final: bool = False) -> list[pa.RecordBatch]:
        return (net_io_batches(self.io.drain(bpf, now_ns, final=final), self.io.width)
                + retransmit_batches(self.retransmits.drain(bpf, now_ns, final=final), self.retransmits.width)
                + device_batches(self.devices.drain(bpf, now_ns, final=final), self.devices.width, self.visible))


def peer_name(family: int, addr: bytes, length: int, port: int) -> str:
    """"10.0.0.2:8080", "[fd00::2]:8080", a UNIX path ("@name" in the abstract
    namespace), or "" for an unnamed UNIX peer, a socket not connected (a UDP socket
    sending to many) or another family."""
    if family in (socketlib.AF_INET, socketlib.AF_INET6) and not port and not any(addr[:length]):
        return ""
    if family == socketlib.AF_INET:
        return f"{ipaddress.IPv4Address(addr[:4])}:{port}"
    if family == socketlib.AF_INET6:
        return f"[{ipaddress.IPv6Address(addr[:16])}]:{port}"
    if family != socketlib.AF_UNIX or length <= 0:
        return ""
    path = addr[:length]
    if path[:1] == b"\0":  # abstract: every byte of the length counts, NULs included
        return "@" + path[1:].decode(errors="replace")
    return path.split(b"\0", 1)[0].decode(errors="replace")


def interface_name(ifindex: int, pid: int) -> str:
    """The name of the interface a socket of process `pid` is bound to; "" when unknown,
    or when the process is in another network namespace than the recorder, where the
    index names another interface."""
    if ifindex <= 0:
        return ""
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino:
            return ""
        return socketlib.if_indextoname(ifindex)
    except OSError:
        return ""


def net_io_batches(counts: dict[str, np.ndarray], width: int) -> list[pa.RecordBatch]:
    """`net_io` rows, and `net_request` rows of the receives that answered a send, of
    BucketCounts columns (bucket, tid, ino, direction, bytes, calls, requests, latency,
    max_latency, pid, comm)."""
    if not len(counts["bucket"]):
        return []
    thread = {"tid": counts["tid"].astype(np.int32), "pid": counts["pid"].astype(np.int32),
              "socket": counts["ino"].astype(np.uint64)}
    batches = [make_batch("net_io", {
        **bucket_span(counts["bucket"], width), **thread,
        "direction": [DIRECTIONS[d] for d in counts["direction"].tolist()],
        "bytes": counts["bytes"],
        "calls": counts["calls"],
    })]
    answered = counts["requests"] > 0
    if answered.any():
        batches.append(make_batch("net_request", {
            **bucket_span(counts["bucket"][answered], width),
            **{name: values[answered] for name, values in thread.items()},
            "requests": counts["requests"][answered],
            "latency_ns": counts["latency"][answered],
            "max_latency_ns": counts["max_latency"][answered].astype(np.float64),
        }))
    return batches


def retransmit_batches(counts: dict[str, np.ndarray], width: int) -> list[pa.RecordBatch]:
    """`retransmit` rows of BucketCounts columns (bucket, ino, count)."""
    if not len(counts["bucket"]):
        return []
    return [make_batch("retransmit", {**bucket_span(counts["bucket"], width), "socket": counts["ino"].astype(np.uint64),
                                      "retransmits": counts["count"]})]


def device_batches(counts: dict[str, np.ndarray], width: int,
                   visible: Callable[[int], bool] | None = None) -> list[pa.RecordBatch]:
    """`net_device` rows of BucketCounts columns (bucket, ifname, direction, tid, bytes,
    packets, pid, comm); a packet no task sent (tid 0) has no pid."""
    if not len(counts["bucket"]):
        return []
    tid, pid = counts["tid"], counts["pid"]
    task = issuers(tid, pid, counts["comm"], visible)
    nobody = tid == 0
    task["pid"] = pa.array(pid.astype(np.int32), mask=nobody | task["pid"].is_null().to_numpy(zero_copy_only=False))
    return [make_batch("net_device", {
        **bucket_span(counts["bucket"], width), **task,
        "interface": counts["ifname"],
        "direction": [DEVICE_DIRECTIONS[d] for d in counts["direction"].tolist()],
        "bytes": counts["bytes"],
        "packets": counts["packets"],
    })]
