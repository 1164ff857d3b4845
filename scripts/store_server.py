"""The store of the network workloads (scripts/workloads/slow_store.py,
competing_upload.py; the scenario tests run it inside a network namespace of its own,
outside the traced tree): on --port it answers each request line "GET <bytes>" after
--delay-ms with that many bytes; on --sink-port it reads and drops whatever is sent (the
object store a checkpoint is uploaded to).  Port 0: any free one.  Prints
"listening PORT SINK_PORT" once both accept; runs until killed (or, with
--die-with-parent, until its parent exits)."""

from __future__ import annotations

import argparse
import ctypes
import signal
import socket
import socketserver
import threading
import time

CHUNK = 1 << 16
MAX_REQUEST_BYTES = 64 << 20


class Store(socketserver.StreamRequestHandler):
    delay_s = 0.03

    def handle(self) -> None:
        payload = b"\0" * CHUNK
        for line in self.rfile:
            words = line.split()
            if len(words) != 2 or words[0] != b"GET" or not words[1].isdigit():
                return
            remaining = min(int(words[1]), MAX_REQUEST_BYTES)
            time.sleep(self.delay_s)  # the store's own latency per request
            while remaining > 0:
                self.wfile.write(payload[:min(CHUNK, remaining)])
                remaining -= CHUNK
            self.wfile.flush()


class Sink(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        buffer = bytearray(CHUNK)
        while self.request.recv_into(buffer):
            pass


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--sink-port", type=int, default=9000)
    parser.add_argument("--delay-ms", type=float, default=30.0)
    parser.add_argument("--die-with-parent", action="store_true")
    args = parser.parse_args()
    if args.die_with_parent:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    Store.delay_s = args.delay_ms / 1000
    servers = [Server((args.address, args.port), Store), Server((args.address, args.sink_port), Sink)]
    for server in servers:
        server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"listening {servers[0].server_address[1]} {servers[1].server_address[1]}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
