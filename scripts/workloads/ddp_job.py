"""A data-parallel job, one process per rank under torchrun: every step each rank runs
a step on its own simulated GPU (GPU LOCAL_RANK: the file $TRAINBPF_SIM_GPU, or
"<file>.<i>" for GPU i, that scripts/fake-nvidia-smi reads with
TRAINBPF_SIM_GPU_COUNT GPUs), then all ranks all-reduce their gradients over gloo.  One
rank can be made late in every step:

- `--slow input`: it decodes its own batches in its own thread (torch's DataLoader with
  the default num_workers=0), about as long as a step;
- `--slow faults`: it maps fresh buffers, faults in every page and unmaps them again;
- `--slow none`: every rank does the same work (a healthy job).

The other ranks wait for the late one inside `all_reduce`.  Needs torch (a CPU build).
Run: torchrun --nproc_per_node=3 ddp_job.py --slow input --slow-rank 1
Expected: the straggler is the slow rank; its cause input_pipeline, or page_faults /
allocator_churn; no straggler with `--slow none`.
"""

import common
import torch
import torch.distributed as dist
from decode_torch import BATCH_SIZE, SlowDecodeDataset
from torch.utils.data import DataLoader

# The slow rank's extra work per step, in GPU steps (--step-ms), unless --slow-steps says.
SLOW_STEPS = 0.75
# Small gradients: the all_reduce itself takes well under a millisecond on loopback.
GRADIENT_ELEMENTS = 1 << 12
FAULT_BUFFER_BYTES = 8 << 20


def add_arguments(parser) -> None:
    parser.add_argument("--slow", choices=("input", "faults", "none"), default="input",
                        help="what makes --slow-rank late: decoding its own batches, page faults, or nothing")
    parser.add_argument("--slow-rank", type=int, default=1, help="the rank that is late (1)")
    parser.add_argument("--slow-steps", type=float, default=SLOW_STEPS,
                        help=f"how late, in GPU steps of its own work per step ({SLOW_STEPS})")


def main() -> None:
    args = common.parse_args(__doc__, add_arguments)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    late = dist.get_rank() == args.slow_rank and args.slow != "none"
    if late and args.slow == "input":
        batches = iter(DataLoader(SlowDecodeDataset(args.slow_steps), batch_size=BATCH_SIZE))  # num_workers=0
    else:
        batches = iter(lambda: None, object())  # batches at hand
    gradients = torch.ones(GRADIENT_ELEMENTS)
    local_rank = int(common.os.environ.get("LOCAL_RANK", "0"))
    gpu = common.SimGpu(common.sim_gpu_path() + (f".{local_rank}" if local_rank else ""))

    def step(batch) -> None:
        if late and args.slow == "faults":
            common.repeat_for(args.slow_steps * common.STEP_S,
                              lambda: common.touch_fresh_mapping(FAULT_BUFFER_BYTES, huge_pages=False))
        gpu.step(common.STEP_S)
        dist.all_reduce(gradients)

    common.announce_ready()
    common.wait_for_go()
    dist.barrier()  # every rank starts its steps together
    stop = common.time.monotonic() + args.seconds
    steps = 0
    while common.time.monotonic() < stop:
        step(next(batches))
        steps += 1
    print(f"rank {dist.get_rank()}: {steps} steps", file=common.sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
