#!/usr/bin/env python3
"""Tracing overhead on the standard trainer workload (issue 5, target 1).

bench/trainer_steps.py runs a fixed number of steps fed by two dataloader threads, with a
buffered checkpoint every 200 steps, and reports the wall time of its steps alone.  Each
round runs it under every tracer, in an order that rotates from round to round, with an
untraced run before each traced one (and one more at the very end); a tracer attaches
(and, for the BPF ones, compiles) before the steps start, so only its cost while tracing
is timed.  The ratio of a traced run to the mean of the untraced runs just before and
after it, median over the rounds, is the overhead.

Tracers: trainbpf with every probe; bcc's offcputime-bpfcc (tried for real: it needs
kprobes, and when it cannot run the reason is printed); offcputime's method ported to
the sched_switch tracepoint (bench/offcputime_tp.*); `perf sched record` of the process.
Afterwards --cost-runs runs (5) each under trainbpf (as shipped: Python frames on),
trainbpf with --no-python-frames (what the frame walk adds), trainbpf with only its
sched probe and no Python frames (what offcputime records, like for like), the
offcputime port and, with --baseline REV,
that git revision's recorder, in rotating order with kernel.bpf_stats_enabled=1
(restored), give each BPF program's in-kernel ns per run and each tool's accounted cost
(in-kernel time + its own process's CPU during the steps), as a share of the workload's
CPU and per context switch, median and range: a comparison the wall-time noise of a
shared machine cannot blur.  They are not among the timed rounds.

Other work on a shared machine moves wall times by tens of percent, so every traced run
sits between two untraced ones (ABAB...), each run starts after a sync and a pause, and
the report adds the CPU-time ratio (workload + tracer CPU), the load on the machine that
was not ours during each run, and the ratios over the quiet pairs alone.

The tracers are in bench/tracers.py, the accounted cost and its tables in
bench/overhead_cost.py.

    sudo .venv/bin/python scripts/bench_overhead.py [--rounds 5] [--steps 1200] [--cost-runs 5]
        [--baseline REV] [--no-perf] [--quick] [--unmapper]     (--rounds 0: the accounted cost alone)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import benchlib as bl  # noqa: E402
from overhead_cost import FLOOR_S, KernelCost, kernel_cost_run, print_costs, recorder_floor  # noqa: E402
from tracers import (COST_TOOLS, OFFCPU_PORT, OFFCPUTIME, PERF_SCHED, TRAINBPF, Offcputime,  # noqa: E402
                     OffcputimePort, PerfSched, Tracer, TracerFailed, Trainbpf, TrainbpfAt, kprobes_note,
                     settle)

QUIET_CPUS = 0.25  # other load under which a pair counts as quiet


@dataclass
class Run:
    tracer: str
    round: int
    wall_s: float  # the workload's steps
    cpu_s: float  # the workload's CPU during the steps, in-kernel probe time included
    tracer_cpu_s: float  # the tracer process's CPU over the same span
    foreign_cpus: float  # other work on the machine meanwhile, in CPUs (noise)
    info: dict = field(default_factory=dict)


def run_once(tracer: Tracer | None, argv: list[str], tmp: Path, round_: int) -> Run:
    out = Path(tempfile.mkdtemp(dir=tmp))
    work = bl.Workload(argv)
    try:
        if tracer:
            tracer.start(work.pid, out)
        settle()
        tpid = tracer.pid if tracer else None
        cpu0, tcpu0, busy0, t0 = bl.cpu_seconds(work.pid), bl.cpu_seconds(tpid) if tpid else 0.0, \
            bl.machine_busy_seconds(), time.monotonic()
        work.go()
        wall = work.result()["wall_s"]
        cpu, tcpu = bl.cpu_seconds(work.pid) - cpu0, (bl.cpu_seconds(tpid) - tcpu0) if tpid else 0.0
        foreign = (bl.machine_busy_seconds() - busy0 - cpu - tcpu) / (time.monotonic() - t0)
        work.finish()
        info = tracer.stop() if tracer else {}
        return Run(tracer.name if tracer else "untraced", round_, wall, cpu, tcpu, max(0.0, foreign), info)
    finally:
        work.kill()
        subprocess.run(["rm", "-rf", str(out)], check=False)


def paired_ratios(runs: list[Run], name: str, value, *, quiet: bool = False) -> list[float]:
    """value(run) of each `name` run over the mean of the untraced runs just before and
    after it (ABAB...: slow drift in the machine's load cancels).  `quiet`: only where
    the other load stayed under QUIET_CPUS in all three runs."""
    ratios = []
    for i, run in enumerate(runs):
        if run.tracer != name:
            continue
        near = [runs[j] for j in (i - 1, i + 1) if 0 <= j < len(runs) and runs[j].tracer == "untraced"]
        if quiet and any(r.foreign_cpus >= QUIET_CPUS for r in [run, *near]):
            continue
        if near:
            ratios.append(value(run) / (sum(value(r) for r in near) / len(near)))
    return ratios


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the cost runs' tool names (exits with a message on an unknown one)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (each runs every tracer once)")
    ap.add_argument("--steps", type=int, default=1200, help="trainer steps per run (~6 s untraced here)")
    ap.add_argument("--no-perf", action="store_true", help="leave perf sched record out")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 400 steps: a smoke test, not a measurement")
    ap.add_argument("--runs-json", metavar="FILE", help="also write every timed run, in order, as JSON lines")
    ap.add_argument("--cost-runs", type=int, default=5,
                    help="runs of each tool under kernel.bpf_stats_enabled for the accounted cost (median, range)")
    ap.add_argument("--tools", default=",".join(COST_TOOLS), metavar="NAMES",
                    help=f"which tools the cost runs measure, of {', '.join(COST_TOOLS)} (default: all)")
    ap.add_argument("--unmapper", action="store_true",
                    help="the workload with a thread unmapping fresh buffers in a loop (TLB shootdowns)")
    ap.add_argument("--baseline", metavar="REV",
                    help="also measure the accounted cost of git revision REV's recorder, alternating with this one")
    args = ap.parse_args()
    chosen = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in COST_TOOLS]
    if unknown or not chosen:
        sys.exit(f"--tools: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(COST_TOOLS)}")
    return args, chosen


def timed_tracers(no_perf: bool, notes: list[str]) -> list[Tracer]:
    """The tracers of the timed rounds; why one is left out goes to `notes`."""
    tracers: list[Tracer] = [Trainbpf(), OffcputimePort()]
    if no_perf:
        pass
    elif shutil.which("perf"):
        tracers.append(PerfSched())
    else:
        notes.append("perf sched record left out: perf is not installed (scripts/setup.sh --bench installs linux-perf)")
    return tracers


def timed_rounds(tracers: list[Tracer], rounds: int, argv: list[str], tmp: Path, notes: list[str]) -> list[Run]:
    """offcputime-bpfcc tried (added to `tracers` if it runs), then `rounds` rounds: each
    tracer's run after an untraced one, and one more untraced run at the end."""
    bl.log("trying offcputime-bpfcc")
    try:
        run_once(Offcputime(), argv + ["--steps", "50"], tmp, -1)
        tracers.append(Offcputime())
    except (TracerFailed, FileNotFoundError) as exc:
        why = kprobes_note()
        notes.append(f"offcputime-bpfcc could not run: {exc}" + (f"; {why}" if why else ""))
        bl.log(notes[-1])
    runs: list[Run] = []
    for r in range(rounds):
        order = tracers[r % len(tracers):] + tracers[: r % len(tracers)]  # rotate: no tracer always first
        for tracer in order:  # untraced before every traced run, and once more at the end
            for t in (None, tracer):
                bl.log(f"round {r + 1}/{rounds}: {t.name if t else 'untraced'}")
                runs.append(run_once(t, argv, tmp, r))
    runs.append(run_once(None, argv, tmp, rounds))
    return runs


def cost_runs(chosen: list[str], baseline: str | None, count: int, argv: list[str],
              tmp: Path) -> dict[str, list[KernelCost]]:
    """Each chosen tool (and the baseline revision's recorder) `count` times, in rotating
    order, under kernel.bpf_stats_enabled."""
    cost_tools: list = [COST_TOOLS[t] for t in chosen]
    if baseline:
        pkg = bl.revision_package(baseline, tmp / "baseline")
        cost_tools.append(lambda: TrainbpfAt(baseline, pkg))
    costs: dict[str, list[KernelCost]] = {}
    with bl.bpf_stats():
        for i in range(count):
            order = cost_tools[i % len(cost_tools):] + cost_tools[: i % len(cost_tools)]
            for make in order:
                tracer = make()
                bl.log(f"cost run {i + 1}/{count} under {tracer.name} (kernel.bpf_stats_enabled)")
                costs.setdefault(tracer.name, []).append(kernel_cost_run(tracer, argv, tmp))
    return costs


def main() -> None:
    args, chosen = parse_args()
    bl.require_root()
    rounds, steps = (2, 400) if args.quick else (args.rounds, args.steps)
    argv = [bl.python(), str(bl.BENCH / "trainer_steps.py"), "--steps", str(steps), "--hold"] + (
        ["--unmapper"] if args.unmapper else [])
    bl.print_machine()
    notes: list[str] = []
    tracers = timed_tracers(args.no_perf, notes)
    with tempfile.TemporaryDirectory(prefix="trainbpf-bench-") as tmp_name:
        tmp = Path(tmp_name)
        runs = timed_rounds(tracers, rounds, argv, tmp, notes)
        if args.runs_json:
            with open(args.runs_json, "w") as fh:
                for run in runs:
                    fh.write(json.dumps({k: v for k, v in run.__dict__.items() if k != "info"}) + "\n")
        costs = cost_runs(chosen, args.baseline, args.cost_runs, argv, tmp)
        floor = None
        if "sched" in chosen and "port" in chosen:
            bl.log(f"the recorder's floor: --probes sched on an idle target for {FLOOR_S:g} s")
            floor = recorder_floor(tmp)

    if not rounds:  # the accounted cost alone
        for note in notes:
            print(f"note: {note}")
        print_costs(costs, floor)
        return
    print_rounds(runs, ["untraced"] + [t.name for t in tracers], steps, notes, costs)


def print_rounds(runs: list[Run], names: list[str], steps: int, notes: list[str],
                 costs: dict[str, list[KernelCost]]) -> None:
    """The timed rounds' tables, the accounted cost's, and the summary's wall-ratio lines."""
    rows, wall_ratio, cpu_ratio = [], {}, {}
    untraced_only = [run for run in runs if run.tracer == "untraced"]
    aa = paired_ratios(untraced_only, "untraced", lambda run: run.wall_s)
    aa_cpu = paired_ratios(untraced_only, "untraced", lambda run: run.cpu_s)
    for name in names:
        mine = [run for run in runs if run.tracer == name]
        wall = paired_ratios(runs, name, lambda run: run.wall_s) if name != "untraced" else []
        cpu = paired_ratios(runs, name, lambda run: run.cpu_s + run.tracer_cpu_s) if name != "untraced" else []
        wall_ratio[name], cpu_ratio[name] = bl.median(wall), bl.median(cpu)
        if name == "untraced":  # untraced against untraced: the noise floor
            wall, cpu = aa, aa_cpu
            wall_ratio[name], cpu_ratio[name] = bl.median(wall), bl.median(cpu)
        rows.append([name + (" (against its untraced neighbours)" if name == "untraced" else ""), len(mine),
                     f"{bl.median([r.wall_s for r in mine]):.3f}",
                     f"{wall_ratio[name]:.3f}" if wall else "-", bl.spread(wall),
                     f"{cpu_ratio[name]:.3f}" if cpu else "-", bl.spread(cpu),
                     f"{bl.median([r.tracer_cpu_s for r in mine]):.2f}",
                     f"{bl.median([r.foreign_cpus for r in mine]):.2f}"])
    print()
    for note in notes:
        print(f"note: {note}")
    bl.print_table(
        f"{steps} trainer steps; each traced run against the untraced runs just before and after it",
        ["run", "runs", "median wall s", "wall ratio", "wall range", "CPU ratio", "CPU range",
         "tracer CPU s", "other load (CPUs)"], rows)
    print("  wall ratio: the issue's measure.  CPU ratio: (workload CPU + tracer CPU) / untraced workload\n"
          "  CPU, steadier when other work shares the machine (other load: busy CPUs not ours).")
    quiet_rows = []
    for name in names[1:]:
        wall = paired_ratios(runs, name, lambda run: run.wall_s, quiet=True)
        cpu = paired_ratios(runs, name, lambda run: run.cpu_s + run.tracer_cpu_s, quiet=True)
        quiet_rows.append([name, len(wall), f"{bl.median(wall):.3f}" if wall else "-", bl.spread(wall),
                           f"{bl.median(cpu):.3f}" if cpu else "-"])
    bl.print_table(f"quiet pairs only (other load < {QUIET_CPUS} CPUs in the traced run and both neighbours)",
                   ["run", "pairs", "wall ratio", "wall range", "CPU ratio"], quiet_rows)
    mine = [run for run in runs if run.tracer == TRAINBPF]
    bl.print_table("trainbpf while tracing (medians)", ["", ""], [
        ["recorder CPU during the steps", f"{bl.median([r.tracer_cpu_s for r in mine]):.2f} s"],
        ["rows recorded", f"{bl.median([r.info['rows'] for r in mine]):.0f}"],
        ["lost events", f"{max(r.info['lost'] for r in mine)} (max)"],
        ["trace file", f"{bl.median([r.info['bytes'] for r in mine]) / 1e6:.2f} MB"],
    ])
    print_costs(costs)
    ours = wall_ratio[TRAINBPF]
    print(f"  trainbpf wall ratio {ours:.3f} (CPU ratio {cpu_ratio[TRAINBPF]:.3f}); inside the noise floor "
          f"(untraced vs untraced {bl.spread(aa)})")
    for name in (OFFCPUTIME, OFFCPU_PORT, PERF_SCHED):
        if name in wall_ratio:
            print(f"  {name}: wall {wall_ratio[name]:.3f}, CPU {cpu_ratio[name]:.3f}")


if __name__ == "__main__":
    main()
