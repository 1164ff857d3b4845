"""The traced side of tests/test_net_probe.py (speaks tests/recording.py's protocol:
says "ready", waits for "go", prints what it did as JSON, exits).  One thread, the
fetcher, sends two datagrams on a UDP socket, connecting it between them, then asks
tests/net_server.py for batches over each socket in turn: IPv4, IPv6
(waiting in select first), a UNIX socket, an IPv4 port to which it uploads batches
whose packets the test drops in part (retransmits), and a request the server answers by closing."""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import sys
import threading

from net_server import CLOSE, UPLOAD

BATCH = 256 << 10
DISCARD_PORT = 9  # nobody listens: the datagrams go nowhere


def fetch(s: socket.socket, size: int, *, wait_in_select: bool = False) -> int:
    """One request: the bytes that came back.  An upload (size with UPLOAD) sends the
    size's other bits, and 4 bytes come back."""
    s.sendall(struct.pack("!I", size) + bytes(size & ~UPLOAD if size != CLOSE and size & UPLOAD else 0))
    if size != CLOSE and size & UPLOAD:
        size = 4
    if wait_in_select:
        select.select([s], [], [])
    got = 0
    while got < size:
        chunk = s.recv(min(size - got, 1 << 20))
        if not chunk:
            break
        got += len(chunk)
    return got


def datagrams(address: tuple[str, int], report: dict) -> None:
    """A UDP socket that sends before and after it is connected: its peer changes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"x", address)
        s.connect(address)
        s.send(b"y")
        report["udp"] = {"socket": os.fstat(s.fileno()).st_ino, "sent": 2, "received": 0}


def fetcher(plan: list[tuple[str, object, int, int]], report: dict) -> None:
    report["tid"] = threading.get_native_id()
    datagrams((plan[0][1][0], DISCARD_PORT), report)
    for name, address, requests, size in plan:
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET6 if ":" in address[0] \
            else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.connect(address)
            got = [fetch(s, size, wait_in_select=name == "ipv6") for _ in range(requests)]
            uploaded = size & ~UPLOAD if size != CLOSE and size & UPLOAD else 0
            report[name] = {"socket": os.fstat(s.fileno()).st_ino, "sent": (4 + uploaded) * requests,
                            "received": sum(got)}


def main(ipv4: str, ipv6: str, port: int, drop_port: int, unix_path: str) -> None:
    plan = [("ipv4", (ipv4, port), 4, BATCH), ("ipv6", (ipv6, port), 2, BATCH), ("unix", unix_path, 2, BATCH),
            ("dropped", (ipv4, drop_port), 3, UPLOAD | 4 * BATCH), ("closed", (ipv4, port), 1, CLOSE)]
    print("ready", flush=True)
    sys.stdin.readline()
    report: dict = {}
    t = threading.Thread(target=fetcher, args=(plan, report), name="fetcher")
    t.start()
    t.join()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
