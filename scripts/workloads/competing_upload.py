"""The upload that competes: the loader fetches its batches from the store (as in
slow_store) while a thread of the job uploads a checkpoint to the store's object sink
over the same link (port 9000 of the store's host), which the scenario test shapes
with tbf to a low rate.

The loader's requests and acknowledgements queue behind the upload's packets on the
shaped interface (alone, the store answers in 5 ms and the loader keeps up), so every
batch comes late.  Expected top finding: network_io,
naming the uploader thread (comm ckpt_upload) with its bytes and rate.
"""

import queue
import threading

import common
import slow_store

UPLOAD_WRITE_BYTES = 1 << 20
# A batch as six 512 KiB requests: every batch then waits about as long behind the
# upload's queue (the GPU partly busy in every sample); with fewer, larger ones the
# waits came in bursts of TCP stalls.
CHUNK_BYTES = 512 << 10
CHUNKS_PER_BATCH = 6


def upload_forever(address: str, stop: threading.Event) -> None:
    """A checkpoint sent to the sink over and over, 1 MiB at a time."""
    sock = slow_store.connect(address)
    chunk = b"\0" * UPLOAD_WRITE_BYTES
    try:
        while not stop.is_set():
            sock.sendall(chunk)
    finally:
        sock.close()


def main() -> None:
    args = common.parse_args(__doc__, slow_store.add_store_argument)
    batches: queue.Queue = queue.Queue(maxsize=1)
    with slow_store.store(args.store) as (address, sink):
        common.start_thread(common.DATALOADER_COMM, slow_store.fetch_forever, address, batches, CHUNK_BYTES,
                            CHUNKS_PER_BATCH)
        with common.background_thread("ckpt_upload", upload_forever, sink, cpus=common.BACKGROUND_CPUS):
            common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
