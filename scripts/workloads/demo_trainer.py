"""The bundled demo (scripts/demo.sh): a small trainer fed by two dataloader threads,
one of which gets the expensive samples and is decode-bound, plus a checkpoint written
through the page cache every few seconds.

Batches are taken from the workers in turn, as torch's DataLoader does, so every other
step waits for the slow worker.
Expected top finding: input_pipeline.
"""

import os
import queue
import threading

import common

# CPU time per batch, in GPU steps: worker 0 keeps up easily, worker 1 takes two and a
# half, so every other step waits about half a step for it.
DECODE_STEPS = (0.33, 2.5)
CHECKPOINT_EVERY_S = 3.0
CHECKPOINT_BYTES = 128 << 20
CHECKPOINT_WRITE_BYTES = 8 << 20


def checkpoint_periodically(path: str, stop: threading.Event) -> None:
    chunk = bytes(CHECKPOINT_WRITE_BYTES)
    while not stop.wait(CHECKPOINT_EVERY_S):
        with open(path, "wb") as f:
            for _ in range(CHECKPOINT_BYTES // CHECKPOINT_WRITE_BYTES):
                f.write(chunk)


def main() -> None:
    args = common.parse_args(__doc__, common.add_dir_argument)
    worker_queues = [queue.Queue(maxsize=2) for _ in DECODE_STEPS]
    for i, (decode_steps, batches) in enumerate(zip(DECODE_STEPS, worker_queues)):
        common.start_dataloader(i, batches, decode_steps * common.STEP_S)
    step = 0

    def next_batch():
        nonlocal step
        step += 1
        return worker_queues[step % len(worker_queues)].get()

    with common.scratch_folder("trainbpf-demo-", args.dir) as folder, \
            common.background_thread("ckpt_writer", checkpoint_periodically, os.path.join(folder, "checkpoint.bin")):
        common.train(args.seconds, next_batch)


if __name__ == "__main__":
    common.run_main(main)
