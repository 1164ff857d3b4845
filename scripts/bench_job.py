#!/usr/bin/env python3
"""Several traces of one job analysed as one (issue 28, item 4): 64 node traces x 8
ranks in <= 60 s on this machine, peak memory <= 2 GB.

Generates the job's traces (bench/gen_job.py: 8 ranks a trace, an all-reduce about
every 100 ms with irregular step lengths, one rank late by 20-30 ms in most steps, each
rank with gloo threads, two DataLoader worker processes, helper threads and its GPU's
samples), then, each in a process of its own:

- one trace alone: `trainbpf analyze NODE0 --format json` (its wall time and peak RSS);
- every trace together, as `trainbpf analyze NODE0 NODE1 ... --format json` runs it
  (trainbpf.analyzers.job_traces.analyze_traces and the JSON report), in-process in a child of
  this script, so that its own peak RSS (the parent's) and its workers' (RUSAGE_CHILDREN:
  the largest one's) are its alone.

Prints the wall times, the memory, the ratio of the two times and whether the targets
are met; the straggler found, as a check.

    .venv/bin/python scripts/bench_job.py [--traces 64] [--ranks 8] [--seconds 20] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import benchlib as bl  # noqa: E402

TARGET_S = 60.0
TARGET_RSS_MIB = 2048


def one_trace(trace: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of `trainbpf analyze TRACE --format json`."""
    cli = Path(bl.python()).with_name("trainbpf")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(cli), "analyze", str(trace), "--format", "json"], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"trainbpf analyze {trace} failed")
    return time.monotonic() - t0, usage.ru_maxrss / 1024


def measure(paths: list[str]) -> dict:
    """In this process: every trace analysed together and the JSON report built; wall
    seconds, this process's peak RSS and its largest worker's, and the straggler."""
    from trainbpf.analyzers.job_traces import analyze_traces
    from trainbpf.reports.traces import build_traces_report

    analysed = [0.0]  # when the last trace came back

    def progress(done: int, total: int) -> None:
        analysed[0] = time.monotonic()
        if done % 8 == 0 or done == total:
            bl.log(f"analysed {done}/{total} traces")

    t0 = time.monotonic()
    report = build_traces_report(analyze_traces(paths, progress=progress))
    t1 = time.monotonic()
    return {"wall_s": t1 - t0, "join_and_report_s": t1 - analysed[0], "ranks": len(report["ranks"]),
            "straggler": report["straggler"], "top": report["findings"][0]["category"] if report["findings"] else None,
            "residuals_ms": [t["residual_offset_ms"] for t in report["traces"]],
            "parent_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "parent_cpu_s": _cpu(resource.RUSAGE_SELF), "workers_cpu_s": _cpu(resource.RUSAGE_CHILDREN),
            "workers": min(len(paths), os.cpu_count() or 1)}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def together(paths: list[Path]) -> dict:
    """measure() in a child process of its own."""
    out = subprocess.run([bl.python(), __file__, "--measure", *map(str, paths)], stdout=subprocess.PIPE, text=True,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per trace")
    ap.add_argument("--seconds", type=float, default=20.0, help="each trace's length")
    ap.add_argument("--keep", type=Path, help="generate the traces here (kept)")
    ap.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    bl.print_machine()
    with tempfile.TemporaryDirectory(prefix="trainbpf-bench-job-") as tmp:
        folder = args.keep or Path(tmp)
        from gen_job import write_job

        bl.log(f"generating {args.traces} traces x {args.ranks} ranks x {args.seconds:g} s into {folder}")
        t0 = time.monotonic()
        paths = write_job(folder, traces=args.traces, ranks_per_trace=args.ranks, seconds=args.seconds)
        bl.log(f"generated in {time.monotonic() - t0:.0f} s")
        import pyarrow.parquet as pq

        rows = [pq.ParquetFile(p).metadata.num_rows for p in paths]
        size = sum(p.stat().st_size for p in paths)
        bl.log("one trace alone")
        single_s, single_rss = one_trace(paths[0])
        bl.log(f"{len(paths)} traces together")
        got = together(paths)
    wall, peak = got["wall_s"], got["parent_rss_mib"] + got["workers"] * got["worker_rss_mib"]
    bl.print_table(f"{len(paths)} traces x {args.ranks} ranks ({args.seconds:g} s each) analysed as one job", ["", ""], [
        ["rows", f"{sum(rows):,} ({bl.median(rows):,.0f} a trace), {size / 1e6:.0f} MB on disk"],
        ["one trace alone (trainbpf analyze, a command)", f"{single_s:.2f} s, peak RSS {single_rss:.0f} MiB"],
        ["every trace together (in-process)", f"{wall:.2f} s ({got['join_and_report_s']:.2f} s of it the join and report)"],
        ["ratio to one trace", f"{wall / single_s:.1f}x for {len(paths)}x the traces ({got['workers']} workers)"],
        ["CPU: workers, parent", f"{got['workers_cpu_s']:.1f} s ({got['workers_cpu_s'] / len(paths):.2f} s a trace), "
                                 f"{got['parent_cpu_s']:.1f} s"],
        ["peak RSS: parent, largest worker", f"{got['parent_rss_mib']:.0f} MiB, {got['worker_rss_mib']:.0f} MiB"],
        ["peak memory at most (parent + workers x largest)", f"{peak:.0f} MiB"],
        ["straggler (rank, category)", f"{(got['straggler'] or {}).get('rank')}, {(got['straggler'] or {}).get('category')}"],
        ["clock residuals, ms (min..max)", f"{min(got['residuals_ms']):+.2f}..{max(got['residuals_ms']):+.2f}"],
    ])
    print("\nsummary")
    print(f"  {len(paths)} traces x {args.ranks} ranks in {wall:.1f} s ({wall / single_s:.1f}x one trace's "
          f"{single_s:.2f} s), peak memory <= {peak:.0f} MiB  [target <= {TARGET_S:.0f} s: "
          f"{'met' if wall <= TARGET_S else 'NOT met'}; <= {TARGET_RSS_MIB} MiB: {'met' if peak <= TARGET_RSS_MIB else 'NOT met'}]")


if __name__ == "__main__":
    main()
