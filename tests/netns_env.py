"""Two network namespaces joined by a veth pair, for a job of two nodes faked on one
machine: node 0 at 10.200.0.1/30, node 1 at 10.200.0.2/30, the addresses set inside
the namespaces only (nothing outside them is ever reached), removed again whatever
happens (removing a namespace removes its end of the pair, and the pair with it).
And a store for the network scenarios: one namespace reached from the host over a veth
pair (the host's end optionally shaped by tbf), its server running inside."""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kernel_env import stop_process

NODE_ADDRESSES = ("10.200.0.1", "10.200.0.2")
PREFIX = 30
NODE_ADDRESSES_V6 = ("fd00:200::1", "fd00:200::2")  # with ipv6=True
PREFIX_V6 = 64
IFA_F_NODAD = 0x02  # usable at once: no duplicate address detection to wait for
NETNS_RUN = "/var/run/netns"


@dataclass(frozen=True)
class Node:
    netns: str  # the namespace's name (ip netns)
    ifname: str  # its end of the veth pair
    address: str
    address_v6: str = ""

    def enter(self) -> list[str]:
        """The command prefix that runs a program inside this node's network namespace."""
        return ["nsenter", f"--net={NETNS_RUN}/{self.netns}"]


@contextlib.contextmanager
def two_nodes(*, ipv6: bool = False) -> Iterator[tuple[Node, Node]]:
    """Two namespaces private to this process, each with its end of one veth pair up and
    addressed (with `ipv6`, an IPv6 address too), and its loopback up."""
    from pyroute2 import NetNS, netns

    tag = f"{os.getpid() % 100000}"
    nodes = tuple(Node(f"trainbpf-test-n{i}-{tag}", f"tbv{i}-{tag}", NODE_ADDRESSES[i],
                       NODE_ADDRESSES_V6[i] if ipv6 else "") for i in range(2))
    made: list[str] = []
    try:
        for node in nodes:
            netns.create(node.netns)
            made.append(node.netns)
        with NetNS(nodes[0].netns) as ns:  # made inside node 0, its peer straight into node 1
            ns.link("add", ifname=nodes[0].ifname, kind="veth",
                    peer={"ifname": nodes[1].ifname, "net_ns_fd": nodes[1].netns})
        for node in nodes:
            with NetNS(node.netns) as ns:
                index = ns.link_lookup(ifname=node.ifname)[0]
                ns.addr("add", index=index, address=node.address, prefixlen=PREFIX)
                if node.address_v6:
                    ns.addr("add", index=index, address=node.address_v6, prefixlen=PREFIX_V6, flags=IFA_F_NODAD)
                ns.link("set", index=index, state="up")
                ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        yield nodes
    finally:
        for name in made:
            with contextlib.suppress(OSError):
                netns.remove(name)


# A store for the network scenarios: the host at 10.201.0.1/30 on its end of a veth
# pair, the store's namespace at 10.201.0.2/30 on the other.
STORE_HOST_ADDRESS, STORE_ADDRESS = "10.201.0.1", "10.201.0.2"
_stores = itertools.count()  # each store of a process its own names


@dataclass(frozen=True)
class StoreLink:
    node: Node  # the store's namespace, its end and address
    host_ifname: str  # the host's end: the interface the host's sockets to the store use


@contextlib.contextmanager
def store_namespace(rate_mbit: float | None = None, queue_ms: float = 30) -> Iterator[StoreLink]:
    """A namespace private to this process reached from the host over a veth pair, both
    ends up and addressed; with `rate_mbit`, the host's end shaped by tbf to that rate,
    its queue holding `queue_ms` of it (what the host sends to the store queues behind it).  Removed whatever happens
    (the namespace's end goes with it, and the pair with that)."""
    from pyroute2 import IPRoute, NetNS, netns

    tag = f"{os.getpid() % 100000}{next(_stores)}"
    node = Node(f"trainbpf-test-store-{tag}", f"tbst{tag}", STORE_ADDRESS)
    host_ifname = f"tbsh{tag}"
    netns.create(node.netns)
    try:
        with IPRoute() as ip:
            ip.link("add", ifname=host_ifname, kind="veth", peer={"ifname": node.ifname, "net_ns_fd": node.netns})
            index = ip.link_lookup(ifname=host_ifname)[0]
            ip.addr("add", index=index, address=STORE_HOST_ADDRESS, prefixlen=PREFIX)
            ip.link("set", index=index, state="up")
            if rate_mbit is not None:
                ip.tc("add", "tbf", index, 0x10000, rate=f"{rate_mbit:g}mbit", burst=32 * 1024, latency=f"{queue_ms:g}ms")
        with NetNS(node.netns) as ns:
            index = ns.link_lookup(ifname=node.ifname)[0]
            ns.addr("add", index=index, address=node.address, prefixlen=PREFIX)
            ns.link("set", index=index, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        yield StoreLink(node, host_ifname)
    finally:
        with contextlib.suppress(Exception), IPRoute() as ip:  # at once: the namespace's end goes later
            ip.link("del", ifname=host_ifname)
        with contextlib.suppress(OSError):
            netns.remove(node.netns)


STORE_SERVER = Path(__file__).resolve().parent.parent / "scripts" / "store_server.py"
STORE_PORT, SINK_PORT = 8080, 9000
STORE_START_TIMEOUT_S = 30


@contextlib.contextmanager
def store_server(link: StoreLink, delay_ms: float) -> Iterator[str]:
    """scripts/store_server.py inside the store's namespace (not a child of anything
    traced), answering after `delay_ms`; yields its "address:port"; stopped on the way out."""
    proc = subprocess.Popen([*link.node.enter(), sys.executable, str(STORE_SERVER), "--port", str(STORE_PORT),
                             "--sink-port", str(SINK_PORT), "--delay-ms", f"{delay_ms:g}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], STORE_START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("listening"):
            proc.kill()
            raise RuntimeError(f"the store did not start: {line!r} {proc.stderr.read()[-1000:]}")
        yield f"{link.node.address}:{STORE_PORT}"
    finally:
        stop_process(proc, timeout=10)
