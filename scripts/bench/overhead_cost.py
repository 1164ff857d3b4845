"""The accounted cost of a tracer (bench_overhead.py's cost runs): each BPF program's
in-kernel time under kernel.bpf_stats_enabled plus the tool's own process's CPU while the
workload's steps run, as a share of the workload's CPU and per context switch; the
recorder's floor on an idle target; and their tables and one summary line a target."""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchlib as bl
from tracers import (OFFCPU_PORT, OFFCPUTIME, TRAINBPF, TRAINBPF_NO_PYTHON, TRAINBPF_SCHED, Tracer,
                     TrainbpfSched, settle)

PYTHON_FRAMES_TARGET_PP = 1.0  # issue 12: Python frames may add at most this many points
TARGETS_NS = {"page fault": 40, "sched_switch": 1000, "on_cpu_sample": 5000}  # issue 13, target 3
# Faults cost in-kernel time where a program runs on each (page_fault_user, before);
# where the recorder reads the kernel's per-thread counters instead, its CPU in the reads
# per fault counted (trace metadata `faults`; that CPU is in the tool's share already).
FAULT_PROGRAM = "page_fault_user"


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


def cell(values: list[float], fmt: str) -> str:
    """Median (min..max)."""
    return f"{format(bl.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def median_run(runs: list[KernelCost]) -> KernelCost:
    return sorted(runs, key=lambda c: c.share)[len(runs) // 2]


def print_costs(costs: dict[str, list[KernelCost]], floor: float | None = None) -> None:
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


def print_events(ours: list[KernelCost]) -> None:
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


def print_summary(costs: dict[str, list[KernelCost]], floor: float | None) -> None:
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
