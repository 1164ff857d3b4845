#!/usr/bin/env python3
"""Analysis speed on a large trace (issue 5, target 3).

Generates a 10M-row trace of a busy trainer (bench/gen_trace.py: ~50 threads, 10 minutes,
the recorder's mix of off-CPU intervals, futex waits, on-CPU samples, faults, mm calls,
short-wait sums, stacks and GPU samples), then times `trainbpf analyze TRACE --format
json` as a command, several times, with its CPU time and peak RSS.  Reports rows/s and
bytes per row on disk, and where the time goes: opening the file, the analyzers (which
read the rows they need), the report (one more run in this process), with the slowest
functions under cProfile when --profile is given.

    .venv/bin/python scripts/bench_analyze.py [--events 10000000] [--repeat 3] [--profile] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import benchlib as bl  # noqa: E402

TARGET_S = 10.0
TARGET_RSS_MIB = 2048


def analyze_command(trace: Path) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MiB) of
    `trainbpf analyze TRACE --format json`."""
    cli = Path(bl.python()).with_name("trainbpf")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(cli), "analyze", str(trace), "--format", "json"], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"trainbpf analyze exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def step_by_step() -> list[list[str]]:
    """Wrap every analyzer function `analyze` calls, to note each one's seconds and the
    RSS after it (and the peak so far).  Returns the rows, filled as they run."""
    import resource

    import trainbpf.analyzers as analyzers

    rows: list[list[str]] = []
    for name, fn in list(vars(analyzers).items()):
        if not callable(fn) or not getattr(fn, "__module__", "").startswith("trainbpf.analyzers."):
            continue

        def timed(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rows.append([_name, f"{time.perf_counter() - t:.2f}", f"{rss_mib():.0f}", f"{peak:.0f}"])
            return out

        setattr(analyzers, name, timed)
    return rows


def phases(trace: Path, profile: bool) -> tuple[list[list[str]], str]:
    """Seconds spent opening, analysing (which reads the rows) and rendering, in this
    process."""
    from trainbpf.analyzers.pipeline import analyze
    from trainbpf.reports.document import build_report
    from trainbpf.trace.reader import read_trace

    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    tr = read_trace(trace)
    t1 = time.perf_counter()
    analysis = analyze(tr)
    t2 = time.perf_counter()
    build_report(analysis)
    t3 = time.perf_counter()
    text = ""
    if prof:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(r"trainbpf|analyzers|trace", 25)
        text = out.getvalue()
    return [["open the trace (read_trace)", f"{t1 - t0:.2f}"],
            ["analyzers, reading the rows they need (analyze)", f"{t2 - t1:.2f}"],
            ["report (build_report)", f"{t3 - t2:.2f}"]], text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10_000_000, help="rows to generate")
    ap.add_argument("--trace", type=Path, help="analyse this trace instead of generating one")
    ap.add_argument("--keep", type=Path, help="keep the generated trace here")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of the command")
    ap.add_argument("--profile", action="store_true", help="cProfile the in-process run")
    ap.add_argument("--steps", action="store_true",
                    help="seconds and RSS after each analyzer step (in-process run; nested steps count twice)")
    ap.add_argument("--quick", action="store_true", help="1M rows, one timed run")
    args = ap.parse_args()
    events, repeat = (1_000_000, 1) if args.quick else (args.events, args.repeat)
    bl.print_machine()
    with tempfile.TemporaryDirectory(prefix="trainbpf-bench-") as tmp:
        trace = args.trace or args.keep or Path(tmp) / "big.parquet"
        if not args.trace:
            from gen_trace import generate

            bl.log(f"generating {events:,} rows into {trace}")
            t0 = time.monotonic()
            generate(trace, events=events)
            bl.log(f"generated in {time.monotonic() - t0:.0f} s")
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(trace).metadata
        rows, size = meta.num_rows, trace.stat().st_size
        runs = []
        for i in range(repeat):
            bl.log(f"trainbpf analyze, run {i + 1}/{repeat}")
            runs.append(analyze_command(trace))
        bl.log("phases, in this process")
        steps = step_by_step() if args.steps else None
        phase_rows, profile = phases(trace, args.profile)

    walls, cpus, rss = ([run[i] for run in runs] for i in range(3))
    wall = bl.median(walls)
    bl.print_table(f"trainbpf analyze --format json on {rows:,} rows", ["", ""], [
        ["rows (events)", f"{rows:,}"],
        ["file", f"{size / 1e6:.1f} MB, {size / rows:.1f} bytes per row"],
        ["wall, median of runs", f"{wall:.2f} s  (runs: {' '.join(f'{w:.2f}' for w in walls)})"],
        # Parts of the analysis run on every CPU: CPU time above wall time is that
        # overlap; CPU time well below it, time others had the CPUs.
        ["CPU (user + sys), median", f"{bl.median(cpus):.2f} s  (runs: {' '.join(f'{c:.2f}' for c in cpus)})"],
        ["rows per second", f"{rows / wall / 1e6:.2f} M/s"],
        ["peak RSS", f"{max(rss):.0f} MiB (max of runs)"],
    ])
    bl.print_table("where the time goes (one more run in this process"
                   + (", under cProfile)" if args.profile else ")"), ["phase", "seconds"], phase_rows)
    if steps:
        bl.print_table("analyzer steps of 0.05 s or more, in call order (a step inside another counts in both)",
                       ["step", "seconds", "RSS after MiB", "peak so far MiB"],
                       [r for r in steps if float(r[1]) >= 0.05])
    if profile:
        print("\n== cProfile, by cumulative time (trainbpf code)\n" + profile)
    print("\nsummary")
    print(f"  {rows:,} rows in {wall:.2f} s ({rows / wall / 1e6:.2f} M rows/s), peak RSS {max(rss):.0f} MiB  "
          f"[target <= {TARGET_S:.0f} s: {'met' if wall <= TARGET_S else 'NOT met'}; "
          f"<= {TARGET_RSS_MIB} MiB: {'met' if max(rss) <= TARGET_RSS_MIB else 'NOT met'}]")


if __name__ == "__main__":
    main()
