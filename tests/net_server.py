"""A store that answers each request late (tests/test_net_probe.py runs it in a network
namespace, untraced): on every TCP port given (IPv4 or IPv6 by the address) and a UNIX
socket path, a request is a 4-byte big-endian size; the answer is that many bytes after
ANSWER_S, or for CLOSE the connection closed after ANSWER_S instead; a size with
UPLOAD set is an upload of the size's other bits, which follow, answered by 4 bytes.  Prints "listening"
once every socket listens."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

ANSWER_S = 0.03
CLOSE = 0xFFFFFFFF
UPLOAD = 0x80000000


def serve(conn: socket.socket) -> None:
    with conn:
        while True:
            head = conn.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            (size,) = struct.unpack("!I", head)
            if size != CLOSE and size & UPLOAD:
                conn.recv(size & ~UPLOAD, socket.MSG_WAITALL)
                size = 4
            time.sleep(ANSWER_S)
            if size == CLOSE:
                return
            conn.sendall(bytes(size))


def accept(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def listen(family: int, address) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    if family != socket.AF_UNIX:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(address)
    s.listen(16)
    return s


def main(unix_path: str, *endpoints: str) -> None:
    listeners = [listen(socket.AF_UNIX, unix_path)]
    for endpoint in endpoints:  # "10.0.0.2:8080", "[fd00::2]:8080"
        host, _, port = endpoint.rpartition(":")
        family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
        listeners.append(listen(family, (host.strip("[]"), int(port))))
    for s in listeners:
        threading.Thread(target=accept, args=(s,), daemon=True).start()
    print("listening", flush=True)
    sys.stdin.read()  # until the test closes our stdin


if __name__ == "__main__":
    main(*sys.argv[1:])
