"""Two network namespaces joined by a veth pair, for a job of two nodes faked on one
machine: node 0 at 10.200.0.1/30, node 1 at 10.200.0.2/30, the addresses set inside
the namespaces only (nothing outside them is ever reached), removed again whatever
happens (removing a namespace removes its end of the pair, and the pair with it)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

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
