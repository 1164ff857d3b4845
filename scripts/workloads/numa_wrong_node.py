"""Remote NUMA: the input pipeline runs on the wrong node.  With the declared topology
below (CPU 0 = node 0, CPU 1 = node 1, the GPU on node 0), the dataloader thread is
pinned to CPU 1, node 1, while the trainer waits for its batches.

One thread, because node 1 has one CPU: two busy threads pinned there would spend
half their time waiting for each other, which is CPU contention, not NUMA.

This machine has one real node, so the test declares the topology to the recorder
(`trainbpf record --topology FILE`; `--topology-out FILE` writes it).
Expected top finding: numa_remote.
"""

import json
import os
import queue

import common

TOPOLOGY = {"nodes": {"0": [0], "1": [1]}, "gpus": [{"index": 0, "node": 0}]}
REMOTE_NODE_CPUS = {1}
# A batch every three steps' time for a one-step step: the GPU idles about two thirds
# of every sample.
DECODE_STEPS = 3


def add_arguments(parser) -> None:
    parser.add_argument("--topology-out", metavar="FILE",
                        help="write the declared topology (JSON) here for the recorder")


def main() -> None:
    args = common.parse_args(__doc__, add_arguments)
    if not REMOTE_NODE_CPUS <= os.sched_getaffinity(0):
        raise SystemExit("numa_wrong_node needs CPUs 0 and 1")
    if args.topology_out:
        with open(args.topology_out, "w") as f:
            json.dump(TOPOLOGY, f)
    batches: queue.Queue = queue.Queue(maxsize=2)
    common.start_dataloader(0, batches, DECODE_STEPS * common.STEP_S, cpus=REMOTE_NODE_CPUS)
    common.train(args.seconds, batches.get)


if __name__ == "__main__":
    common.run_main(main)
