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

    sudo .venv/bin/python scripts/bench_overhead.py [--rounds 5] [--steps 1200] [--cost-runs 5]
        [--baseline REV] [--no-perf] [--quick]     (--rounds 0: the accounted cost alone)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import benchlib as bl  # noqa: E402

TRAINBPF = "trainbpf (every probe, Python frames included)"
TRAINBPF_SCHED = "trainbpf, sched probe only, --no-python-frames"
TRAINBPF_NO_PYTHON = "trainbpf (every probe, --no-python-frames)"
PYTHON_FRAMES_TARGET_PP = 1.0  # issue 12: Python frames may add at most this many points
OFFCPUTIME = "offcputime-bpfcc"
OFFCPU_PORT = "offcputime method on sched_switch tracepoint (offcputime-bpfcc itself needs kprobes)"
PERF_SCHED = "perf sched record"
ATTACH_TIMEOUT_S = 120
SETTLE_S = 2.0
QUIET_CPUS = 0.25  # other load under which a pair counts as quiet


class Tracer:
    """Attaches to a process before its steps start; detaches after they end."""

    name: str

    def start(self, pid: int, out: Path) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        """The tracer's own process, whose CPU counts as overhead."""
        return self.proc.pid

    def stop(self) -> dict:
        return {}


class Trainbpf(Tracer):
    """The recorder as shipped: every probe, the defaults (Python frames on)."""

    name = TRAINBPF
    probes: list[str] | None = None  # every probe
    settings: dict = {}

    def start(self, pid: int, out: Path) -> None:
        self.rec = bl.Recording(pid=pid, output=out / "trace.parquet", probes=self.probes,
                                settings=self.settings).start(ATTACH_TIMEOUT_S)
        self.proc = self.rec.proc

    def stop(self) -> dict:
        result = self.rec.stop()
        return {"rows": result["rows"], "lost": sum(result["lost"].values()), "bytes": result["bytes"],
                "faults": result.get("faults") or {}}


class TrainbpfAt(Trainbpf):
    """Another revision's recorder (bl.revision_package), every probe: before/after in one run."""

    def __init__(self, rev: str, pythonpath: Path):
        self.name = f"trainbpf at {rev} (every probe)"
        self.pythonpath = str(pythonpath)

    def start(self, pid: int, out: Path) -> None:
        self.rec = bl.Recording(pid=pid, output=out / "trace.parquet", pythonpath=self.pythonpath)
        self.rec.start(ATTACH_TIMEOUT_S)
        self.proc = self.rec.proc


class TrainbpfNoPython(Trainbpf):
    """Every probe without the CPython frame walk (probes/pyframes.h): what the walk adds."""

    name = TRAINBPF_NO_PYTHON
    settings = {"python_frames": False}


class TrainbpfSched(Trainbpf):
    """The probe that records what offcputime records (off-CPU intervals with native
    stacks: offcputime walks no Python frames)."""

    name = TRAINBPF_SCHED
    probes = ["sched"]
    settings = {"python_frames": False}


class _Process(Tracer):
    """A tracer that is a command; attached once it prints `attached` (or after a grace
    period for tools that print nothing)."""

    grace_s = 0.0

    def argv(self, pid: int, out: Path) -> list[str]:
        raise NotImplementedError

    def start(self, pid: int, out: Path) -> None:
        self.proc = subprocess.Popen(self.argv(pid, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=bl.bcc_env())
        if self.grace_s:
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                return  # still running: attached
            raise TracerFailed(failure_line(self.proc.stderr.read()))
        line = bl.readline(self.proc, ATTACH_TIMEOUT_S)
        if line.strip() != "attached":
            self.proc.kill()
            raise TracerFailed(failure_line(self.proc.stderr.read() or line))

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=300)
        return {}


class OffcputimePort(_Process):
    name = OFFCPU_PORT

    def argv(self, pid: int, out: Path) -> list[str]:
        return [bl.python(), str(bl.BENCH / "offcputime_tp.py"), "--pid", str(pid), "--output", str(out / "folded.txt")]


COST_TOOLS = {"every": Trainbpf, "no-python": TrainbpfNoPython, "sched": TrainbpfSched, "port": OffcputimePort}


class Offcputime(_Process):
    """bcc's own tool.  It prints nothing until it ends, so it counts as attached once it
    has outlived its compile (and has not failed)."""

    name = OFFCPUTIME
    grace_s = 30.0

    def argv(self, pid: int, out: Path) -> list[str]:
        return ["offcputime-bpfcc", "-f", "-p", str(pid)]


class PerfSched(Tracer):
    name = PERF_SCHED

    def start(self, pid: int, out: Path) -> None:
        self.data = out / "perf.data"
        self.proc = subprocess.Popen(["perf", "sched", "record", "-o", str(self.data), "-p", str(pid)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # perf prints nothing on attach; it needs well under a second here
        if self.proc.poll() is not None:
            raise TracerFailed(failure_line(self.proc.stderr.read()))

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=300)
        return {"bytes": self.data.stat().st_size if self.data.exists() else 0}


class TracerFailed(Exception):
    pass


def failure_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "exited without a message"


def kprobes_note() -> str:
    """Why kprobe-based tools cannot attach here, when the kernel config says so."""
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")):
        try:
            text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        except OSError:
            continue
        if "# CONFIG_KPROBES is not set" in text:
            return "this kernel is built without kprobes (# CONFIG_KPROBES is not set)"
    return ""


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


def settle() -> None:
    """The same start for every run: the previous run's checkpoints written back, the
    previous tracer's exit done with (else whichever run comes right after another is
    slower: untraced runs, which have no attach to wait for)."""
    os.sync()
    time.sleep(SETTLE_S)


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


def main() -> None:
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
    ap.add_argument("--baseline", metavar="REV",
                    help="also measure the accounted cost of git revision REV's recorder, alternating with this one")
    args = ap.parse_args()
    chosen = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in COST_TOOLS]
    if unknown or not chosen:
        sys.exit(f"--tools: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(COST_TOOLS)}")
    bl.require_root()
    rounds, steps = (2, 400) if args.quick else (args.rounds, args.steps)
    argv = [bl.python(), str(bl.BENCH / "trainer_steps.py"), "--steps", str(steps), "--hold"]
    bl.print_machine()

    tracers: list[Tracer] = [Trainbpf(), OffcputimePort()]
    notes = []
    if args.no_perf:
        pass
    elif shutil.which("perf"):
        tracers.append(PerfSched())
    else:
        notes.append("perf sched record left out: perf is not installed (scripts/setup.sh --bench installs linux-perf)")
    with tempfile.TemporaryDirectory(prefix="trainbpf-bench-") as tmp_name:
        tmp = Path(tmp_name)
        bl.log("trying offcputime-bpfcc")
        try:
            run_once(Offcputime(), argv + ["--steps", "50"], tmp, -1)
            tracers.append(Offcputime())
        except (TracerFailed, FileNotFoundError) as exc:
            why = kprobes_note()
            notes.append(f"offcputime-bpfcc could not run: {exc}" + (f"; {why}" if why else ""))
            bl.log(notes[-1])
        names = ["untraced"] + [t.name for t in tracers]
        runs: list[Run] = []
        for r in range(rounds):
            order = tracers[r % len(tracers):] + tracers[: r % len(tracers)]  # rotate: no tracer always first
            for tracer in order:  # untraced before every traced run, and once more at the end
                for t in (None, tracer):
                    bl.log(f"round {r + 1}/{rounds}: {t.name if t else 'untraced'}")
                    runs.append(run_once(t, argv, tmp, r))
        runs.append(run_once(None, argv, tmp, rounds))
        if args.runs_json:
            with open(args.runs_json, "w") as fh:
                for run in runs:
                    fh.write(json.dumps({k: v for k, v in run.__dict__.items() if k != "info"}) + "\n")
        cost_tools: list = [COST_TOOLS[t] for t in chosen]
        if args.baseline:
            pkg = bl.revision_package(args.baseline, tmp / "baseline")
            cost_tools.append(lambda: TrainbpfAt(args.baseline, pkg))
        costs: dict[str, list[KernelCost]] = {}
        with bl.bpf_stats():
            for i in range(args.cost_runs):
                order = cost_tools[i % len(cost_tools):] + cost_tools[: i % len(cost_tools)]
                for make in order:
                    tracer = make()
                    bl.log(f"cost run {i + 1}/{args.cost_runs} under {tracer.name} (kernel.bpf_stats_enabled)")
                    costs.setdefault(tracer.name, []).append(kernel_cost_run(tracer, argv, tmp))
        floor = None
        if "sched" in chosen and "port" in chosen:
            bl.log(f"the recorder's floor: --probes sched on an idle target for {FLOOR_S:g} s")
            floor = recorder_floor(tmp)

    if not rounds:  # the accounted cost alone
        for note in notes:
            print(f"note: {note}")
        print_costs(costs, floor)
        return
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


TARGETS_NS = {"page fault": 40, "sched_switch": 1000, "on_cpu_sample": 5000}  # issue 13, target 3
# Faults cost in-kernel time where a program runs on each (page_fault_user, before);
# where the recorder reads the kernel's per-thread counters instead, its CPU in the reads
# per fault counted (trace metadata `faults`; that CPU is in the tool's share already).
FAULT_PROGRAM = "page_fault_user"


def cell(values: list[float], fmt: str) -> str:
    """Median (min..max)."""
    return f"{format(bl.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def median_run(runs: list["KernelCost"]) -> "KernelCost":
    return sorted(runs, key=lambda c: c.share)[len(runs) // 2]


def print_costs(costs: dict[str, list["KernelCost"]], floor: float | None = None) -> None:
    """The accounted cost of each tool over its runs (median and range), per context
    switch; the in-kernel cost per event and per program; the targets."""
    rows = []
    for name, runs in costs.items():
        rows.append([name, str(len(runs)),
                     cell([100 * c.kernel_share for c in runs], ".2f"), cell([100 * c.tool_share for c in runs], ".2f"),
                     cell([100 * c.share for c in runs], ".2f"),
                     cell([c.kernel_ns_per_switch for c in runs], ".0f"), cell([c.ns_per_switch for c in runs], ".0f")])
    bl.print_table("accounted cost, % of the workload's CPU (kernel.bpf_stats_enabled; median (range) over runs)",
                   ["tool", "runs", "in-kernel %", "tool CPU %", "accounted %",
                    "in-kernel ns per context switch", "accounted ns per context switch"], rows)
    print("  in-kernel: every program's run time (bpf_stats, which adds ~60 ns of clock reads per run); tool CPU:\n"
          "  the tool's own process during the steps (its CPU-time clock); per context switch: over the runs of\n"
          "  the tool's sched_switch program (every switch on the machine while it is loaded)")
    if TRAINBPF in costs:
        print_events(costs[TRAINBPF])
    for name, runs in costs.items():
        if name != OFFCPUTIME:
            bl.print_table(f"in-kernel cost per program, {name}, the run with the median accounted cost",
                           ["program", "runs", "total ms", "ns/run"], median_run(runs).rows)
    print("\nsummary")
    print_summary(costs, floor)


def print_events(ours: list["KernelCost"]) -> None:
    """The in-kernel cost per event of the recorder with every probe, against target 3."""
    event_rows = []
    for program, target in TARGETS_NS.items():
        values = [c.per_run(program) for c in ours]
        med = bl.median(values)
        event_rows.append([program, cell(values, ".0f"), str(target), "met" if med <= target else
                           f"NOT met (x{med / target:.1f})"])
    bl.print_table(f"in-kernel ns per event, {TRAINBPF}, median (range) over runs",
                   ["program", "ns/run", "target ns", "status"], event_rows)
    if not any(r[0] == FAULT_PROGRAM for c in ours for r in c.rows):
        print("  page fault: no program runs on a fault; the row is the recorder's CPU reading the kernel's\n"
              "  per-thread fault counters, per fault counted (part of the tool CPU above)")


def print_summary(costs: dict[str, list["KernelCost"]], floor: float | None) -> None:
    """One line a target, for the tools measured (--tools)."""
    def share(name: str) -> float:
        return bl.median([c.share for c in costs[name]])

    if TRAINBPF in costs:
        ours = costs[TRAINBPF]
        print(f"  1. every probe: accounted cost {100 * share(TRAINBPF):.2f}% of the workload's CPU "
              f"(range {100 * min(c.share for c in ours):.2f}..{100 * max(c.share for c in ours):.2f})  "
              f"[target <= 2.0%: {'met' if share(TRAINBPF) <= 0.02 else 'NOT met'}; aim 1%]")
    if TRAINBPF_SCHED in costs and OFFCPU_PORT in costs:
        sched, port = costs[TRAINBPF_SCHED], costs[OFFCPU_PORT]
        # 2a is the probes' cost (2b adds the recorder's): were it the accounted cost,
        # 2b's 1.5x allowance could never apply.
        s_sw, p_sw = (bl.median([c.kernel_ns_per_switch for c in runs]) for runs in (sched, port))
        print(f"  2a. per context switch, in-kernel: --probes sched {s_sw:.0f} ns, offcputime port {p_sw:.0f} ns "
              f"({s_sw / p_sw:.2f}x)  [target: at most the port's: {'met' if s_sw <= p_sw else 'NOT met'}]")
        s_ac, p_ac = (bl.median([c.ns_per_switch for c in runs]) for runs in (sched, port))
        print(f"      accounted (the recorder's CPU included): {s_ac:.0f} ns and {p_ac:.0f} ns")
        s_sh, p_sh = share(TRAINBPF_SCHED), share(OFFCPU_PORT)
        print(f"  2b. total accounted: --probes sched {100 * s_sh:.2f}%, offcputime port {100 * p_sh:.2f}% "
              f"({s_sh / p_sh:.2f}x)  [target <= 1.5x: {'met' if s_sh <= 1.5 * p_sh else 'NOT met'}]")
        budget = 1.5 * p_sh - bl.median([c.kernel_share for c in sched])
        print(f"      what 2b leaves the recorder: 1.5 x port - sched's in-kernel = {100 * budget:.2f}% of the "
              f"workload's CPU; it used {100 * bl.median([c.tool_share for c in sched]):.2f}%")
        if floor is not None:
            rate = bl.median([c.workload_cpu_s / c.wall_s for c in sched])  # the workload's CPUs while stepping
            print(f"      the recorder's floor (an idle target; wake-ups and the crash-safe flush every second): "
                  f"{1e3 * floor:.2f} ms CPU a second = {100 * floor / rate:.2f}% of this workload's CPU rate "
                  f"({rate:.2f} CPUs)")
    if TRAINBPF in costs and TRAINBPF_NO_PYTHON in costs:
        every, without = share(TRAINBPF), share(TRAINBPF_NO_PYTHON)
        added = 100 * (every - without)
        print(f"  Python frames: accounted {100 * every:.2f}% with them, {100 * without:.2f}% with --no-python-frames "
              f"({added:+.2f} points)  [target <= +{PYTHON_FRAMES_TARGET_PP:g}: "
              f"{'met' if added <= PYTHON_FRAMES_TARGET_PP else 'NOT met'}]")
    for name, runs in costs.items():
        if name.startswith("trainbpf at ") and TRAINBPF in costs:
            every, base = share(TRAINBPF), share(name)
            print(f"  {name}: accounted {100 * base:.2f}% (this revision {100 * every:.2f}%, "
                  f"{every / base:.2f}x); tool CPU {100 * bl.median([c.tool_share for c in runs]):.2f}% "
                  f"vs {100 * bl.median([c.tool_share for c in costs[TRAINBPF]]):.2f}%")


@dataclass
class KernelCost:
    rows: list[list[str]]  # program, runs, total ms, ns/run
    bpf_s: float  # in-kernel seconds, every program
    workload_cpu_s: float  # the workload's CPU during the steps, in-kernel time included
    tool_cpu_s: float  # the tool's own process over the same span
    wall_s: float  # the steps' wall time

    @property
    def kernel_share(self) -> float:
        return self.bpf_s / self.workload_cpu_s

    @property
    def tool_share(self) -> float:
        return self.tool_cpu_s / self.workload_cpu_s

    @property
    def share(self) -> float:
        """What the tool cost, as a share of the workload's CPU."""
        return (self.bpf_s + self.tool_cpu_s) / self.workload_cpu_s

    @property
    def switches(self) -> int:
        return sum(int(r[1]) for r in self.rows if r[0] == "sched_switch")

    @property
    def kernel_ns_per_switch(self) -> float:
        return self.bpf_s * 1e9 / max(1, self.switches)

    @property
    def ns_per_switch(self) -> float:
        """In-kernel time and the tool's CPU, per context switch."""
        return (self.bpf_s + self.tool_cpu_s) * 1e9 / max(1, self.switches)

    fault_reads: dict = field(default_factory=dict)  # trace metadata `faults`, where counters were read

    def per_run(self, program: str) -> float:
        if program == "page fault":
            if any(r[0] == FAULT_PROGRAM for r in self.rows):
                return self.per_run(FAULT_PROGRAM)
            counted = self.fault_reads.get("counted", 0)
            return self.fault_reads.get("read_cpu_ns", 0) / counted if counted else float("nan")
        runs = [(int(r[1]), float(r[2])) for r in self.rows if r[0] == program]
        return sum(ms for _, ms in runs) * 1e6 / max(1, sum(n for n, _ in runs)) if runs else float("nan")


FLOOR_S = 10.0


def recorder_floor(tmp: Path) -> float:
    """The recorder's CPU per second (--probes sched, no Python frames) on a target that
    does nothing: what its wake-ups and once-a-second crash-safe flush cost before any
    event is recorded."""
    target = subprocess.Popen(["sleep", str(int(FLOOR_S + 120))])
    tracer = TrainbpfSched()
    out = Path(tempfile.mkdtemp(dir=tmp))
    try:
        tracer.start(target.pid, out)
        settle()
        cpu0, t0 = bl.cpu_seconds(tracer.pid), time.monotonic()
        time.sleep(FLOOR_S)
        cpu, span = bl.cpu_seconds(tracer.pid) - cpu0, time.monotonic() - t0
        tracer.stop()
        return cpu / span
    finally:
        target.kill()
        target.wait()
        if tracer.proc.poll() is None:
            tracer.proc.kill()
        subprocess.run(["rm", "-rf", str(out)], check=False)


def kernel_cost_run(tracer: Tracer, argv: list[str], tmp: Path) -> KernelCost:
    """`tracer`'s programs over one run of the workload, read while they are loaded."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    work = bl.Workload(argv)
    try:
        tracer.start(work.pid, out)
        settle()
        cpu0, tcpu0 = bl.cpu_seconds(work.pid), bl.cpu_seconds(tracer.pid)
        work.go()
        wall = work.result()["wall_s"]
        cpu, tcpu = bl.cpu_seconds(work.pid) - cpu0, bl.cpu_seconds(tracer.pid) - tcpu0
        rows = bl.kernel_cost_rows(tracer.pid)  # while the programs are still loaded
        work.finish()
        stopped = tracer.stop()
        return KernelCost(rows, sum(float(r[2]) for r in rows) / 1e3, cpu, tcpu, wall, stopped.get("faults") or {})
    finally:
        work.kill()
        if tracer.proc.poll() is None:
            tracer.proc.kill()
        subprocess.run(["rm", "-rf", str(out)], check=False)


if __name__ == "__main__":
    main()
