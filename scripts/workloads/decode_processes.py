"""Input-pipeline bound, with worker processes: two forked dataloader processes (comm
pt_data_worker, as torch names them) decode batches slower than the GPU consumes them
and send them through a pipe.

The trainer blocks reading the pipe and is woken by the worker process that was on-CPU
decoding until it wrote the batch.
Expected top finding: input_pipeline.
"""

import multiprocessing

import common
from decode_threads import DECODE_STEPS, N_WORKERS


def worker_main(batches) -> None:
    common.set_comm(common.DATALOADER_COMM)
    common.die_with_parent()
    common.wait_for_go()
    while True:
        batches.put(common.decode_batch(DECODE_STEPS * common.STEP_S))


def main() -> None:
    args = common.parse_args(__doc__)
    ctx = multiprocessing.get_context("fork")
    # SimpleQueue writes straight into its pipe (Queue would add a feeder thread, and a
    # second hop, between the decoding worker and the trainer).
    batches = ctx.SimpleQueue()
    workers = [ctx.Process(target=worker_main, args=(batches,), daemon=True,
                           name=f"{common.DATALOADER_COMM}_{i}") for i in range(N_WORKERS)]
    for worker in workers:
        worker.start()
    try:
        common.train(args.seconds, batches.get)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join(timeout=2)


if __name__ == "__main__":
    common.run_main(main)
