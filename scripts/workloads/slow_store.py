"""Network wait: a dataloader thread fetches every batch from a store over TCP, and the
store takes about 30 ms to answer each request; the trainer waits for the loader.

The store runs outside the traced process (the scenario test starts it in a network
namespace of its own, reached over a veth pair: tests/netns_env.py, tests/store_server.py).
A batch is two 1 MiB chunks, one request each, so the loader needs about 60 ms a batch
against the trainer's 40 ms steps: the trainer waits about a third of the time.
Expected top finding: network_io, naming the store's address and port.
"""

import contextlib
import os
import queue
import socket
import subprocess
import sys

import common

STORE_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "store_server.py")

CHUNK_BYTES = 1 << 20
CHUNKS_PER_BATCH = 2


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def fetch(sock: socket.socket, buffer: memoryview) -> None:
    """One request for len(buffer) bytes, and its answer read whole."""
    sock.sendall(b"GET %d\n" % len(buffer))
    got = 0
    while got < len(buffer):
        n = sock.recv_into(buffer[got:])
        if not n:
            raise ConnectionError("the store closed the connection")
        got += n


def fetch_forever(address: str, batches: queue.Queue, chunk_bytes: int = CHUNK_BYTES,
                  chunks: int = CHUNKS_PER_BATCH) -> None:
    sock = connect(address)
    buffer = memoryview(bytearray(chunk_bytes))
    while True:
        for _ in range(chunks):
            fetch(sock, buffer)
        batches.put(bytes(buffer[:1 << 12]))


def add_store_argument(parser) -> None:
    parser.add_argument("--store", help="the store's HOST:PORT (default: a store of its own on 127.0.0.1)")


@contextlib.contextmanager
def store(address: str | None):
    """(store, sink) addresses: `address` and its sink port 9000, or a store of the
    workload's own on 127.0.0.1 (scripts/store_server.py, stopped on the way out)."""
    if address is not None:
        yield address, f"{address.rsplit(':', 1)[0]}:9000"
        return
    server = subprocess.Popen([sys.executable, STORE_SERVER, "--address", "127.0.0.1", "--port", "0",
                               "--sink-port", "0", "--die-with-parent"], stdout=subprocess.PIPE, text=True)
    try:
        words = server.stdout.readline().split()
        if len(words) != 3 or words[0] != "listening":
            raise SystemExit(f"the store did not start: {words}")
        yield f"127.0.0.1:{words[1]}", f"127.0.0.1:{words[2]}"
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    args = common.parse_args(__doc__, add_store_argument)
    batches: queue.Queue = queue.Queue(maxsize=1)
    with store(args.store) as (address, _):
        common.start_thread(common.DATALOADER_COMM, fetch_forever, address, batches)
        common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
