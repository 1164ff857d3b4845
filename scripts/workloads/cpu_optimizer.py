"""Host-bound on the CPU optimizer: after every GPU step the trainer updates its
parameters with an Adam step in numpy on the CPU (about three quarters of a step of CPU
time), before it launches the next step.  Batches are at hand at once.

Every array is allocated once and updated in place (`out=`), so the step is CPU work,
not page faults on fresh temporaries.
Expected top finding: host_compute, `adam_step` named.
"""

import time

import numpy as np

import common

OPTIMIZER_STEPS = 0.75
CHUNK = 1 << 14  # parameters updated per pass: small arrays, no fresh mappings
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


class Adam:
    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.param = rng.random(CHUNK, dtype=np.float32)
        self.grad = rng.random(CHUNK, dtype=np.float32)
        self.m = np.zeros(CHUNK, np.float32)
        self.v = np.zeros(CHUNK, np.float32)
        self.tmp = np.empty(CHUNK, np.float32)


def adam_step(opt: Adam, cpu_seconds: float) -> None:
    """Adam over the parameters, chunk after chunk, for `cpu_seconds` of CPU time."""
    stop = time.thread_time() + cpu_seconds
    while time.thread_time() < stop:
        np.multiply(opt.m, BETA1, out=opt.m)
        np.multiply(opt.grad, 1 - BETA1, out=opt.tmp)
        np.add(opt.m, opt.tmp, out=opt.m)
        np.multiply(opt.grad, opt.grad, out=opt.tmp)
        np.multiply(opt.tmp, 1 - BETA2, out=opt.tmp)
        np.multiply(opt.v, BETA2, out=opt.v)
        np.add(opt.v, opt.tmp, out=opt.v)
        np.sqrt(opt.v, out=opt.tmp)
        np.add(opt.tmp, EPS, out=opt.tmp)
        np.divide(opt.m, opt.tmp, out=opt.tmp)
        np.multiply(opt.tmp, LR, out=opt.tmp)
        np.subtract(opt.param, opt.tmp, out=opt.param)


def main() -> None:
    args = common.parse_args(__doc__)
    opt = Adam()
    common.train(args.seconds, before_step=lambda batch: adam_step(opt, OPTIMIZER_STEPS * common.STEP_S))


if __name__ == "__main__":
    common.run_main(main)
