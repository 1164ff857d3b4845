"""Run bench/offcputime_tp.bpf.c (offcputime's method on the sched_switch tracepoint)
against one process until SIGINT or the process exits, then print what offcputime -f
prints: one folded stack per line with its off-CPU microseconds.  Prints "attached" on
stdout once the program is loaded.

    python offcputime_tp.py --pid PID [--output FOLDED]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from trainbpf.tracer.kheaders import use_headers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--output", default="-")
    args = ap.parse_args()
    use_headers()
    from bcc import BPF

    src = Path(__file__).with_name("offcputime_tp.bpf.c")
    b = BPF(src_file=str(src), cflags=[f"-DTARGET_TGID={args.pid}", "-w"])
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("attached", flush=True)
    while not stop and os.path.exists(f"/proc/{args.pid}"):
        time.sleep(0.1)

    counts, stacks = b["counts"], b["stack_traces"]
    out = sys.stdout if args.output == "-" else open(args.output, "w")
    for k, v in sorted(counts.items(), key=lambda kv: kv[1].value):
        line = [k.name.decode("utf-8", "replace")]
        line += ["[Missed User Stack]"] if k.user_stack_id < 0 else \
            [b.sym(a, k.tgid).decode("utf-8", "replace") for a in reversed(list(stacks.walk(k.user_stack_id)))]
        line += ["[Missed Kernel Stack]"] if k.kernel_stack_id < 0 else \
            [b.ksym(a).decode("utf-8", "replace") for a in reversed(list(stacks.walk(k.kernel_stack_id)))]
        print(f"{';'.join(line)} {v.value}", file=out)
    out.flush()


if __name__ == "__main__":
    main()
