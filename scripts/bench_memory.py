#!/usr/bin/env python3
"""Recorder memory over a long high-rate recording (issue 5, target 4).

Records bench/pingpong.c (one pair of threads pinned to a CPU, handing a token back and
forth as fast as they can) for five minutes with every off-CPU interval streamed
(--min-block-us 0, ~100k events/s here), samples the recorder's RSS as it goes, then
stops it and reports its peak RSS over its whole life, finalising included.

    sudo .venv/bin/python scripts/bench_memory.py [--seconds 300] [--min-block-us 0] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import benchlib as bl  # noqa: E402

FLAT_MIB = 64  # what "flat" allows between the first sample after warm-up and the last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0, help="length of the recording")
    ap.add_argument("--pairs", type=int, default=1, help="ping-pong pairs")
    ap.add_argument("--min-block-us", type=float, default=0.0, help="0 streams every off-CPU interval")
    ap.add_argument("--every", type=float, default=15.0, help="seconds between RSS samples")
    ap.add_argument("--quick", action="store_true", help="40 s, samples every 5 s")
    args = ap.parse_args()
    bl.require_root()
    seconds, every = (40.0, 5.0) if args.quick else (args.seconds, args.every)
    bl.print_machine()
    samples = []
    with tempfile.TemporaryDirectory(prefix="trainbpf-bench-") as tmp:
        exe = bl.compile_c(bl.BENCH / "pingpong.c", Path(tmp))
        out = Path(tmp) / "long.parquet"
        spool = out.with_name(out.name + ".spool")
        work = bl.Workload([str(exe), str(seconds), str(args.pairs), "wait"])
        try:
            rec = bl.Recording(pid=work.pid, output=out,
                               settings={"min_block_ns": int(args.min_block_us * 1000)}).start()
            work.go()
            t0 = time.monotonic()
            while work.proc.poll() is None:
                elapsed = time.monotonic() - t0
                samples.append((elapsed, bl.rss_mib(rec.recorder_pid), spool.stat().st_size if spool.exists() else 0))
                bl.log(f"{elapsed:5.0f} s  recorder RSS {samples[-1][1]:.0f} MiB  spool {samples[-1][2] / 1e6:.0f} MB")
                time.sleep(min(every, max(0.1, seconds - elapsed + 0.5)))
            work.finish()
            t_stop = time.monotonic()
            result = rec.stop()
            finalize_s = time.monotonic() - t_stop
        finally:
            work.kill()
        trace_mb = out.stat().st_size / 1e6 if out.exists() else 0.0

    warm = next((s for s in samples if s[0] >= min(30.0, seconds / 4)), samples[0])
    last = samples[-1]
    events = result["rows"]
    bl.print_table("recorder RSS while recording", ["seconds", "RSS MiB", "spool MB"],
                   [[f"{t:.0f}", f"{r:.0f}", f"{s / 1e6:.0f}"] for t, r, s in samples])
    bl.print_table("summary figures", ["", ""], [
        ["recorded", f"{result['duration_s']:.0f} s, {events:,} rows ({events / result['duration_s'] / 1e3:.0f}k/s), "
                     f"lost {sum(result['lost'].values())}"],
        ["RSS at start (first sample)", f"{samples[0][1]:.0f} MiB"],
        [f"RSS after warm-up ({warm[0]:.0f} s)", f"{warm[1]:.0f} MiB"],
        [f"RSS at the end ({last[0]:.0f} s)", f"{last[1]:.0f} MiB"],
        ["peak RSS over the recorder's life (finalising included)", f"{rec.peak_rss_mib:.0f} MiB"],
        ["stop to exit (finalising the Parquet file)", f"{finalize_s:.1f} s"],
        ["trace file", f"{trace_mb:.0f} MB ({trace_mb * 1e6 / max(events, 1):.1f} bytes per row)"],
    ])
    growth = last[1] - warm[1]
    print("\nsummary")
    print(f"  RSS {warm[1]:.0f} -> {last[1]:.0f} MiB while recording ({growth:+.0f} MiB)  "
          f"[flat within {FLAT_MIB} MiB: {'met' if abs(growth) <= FLAT_MIB else 'NOT met'}]; "
          f"peak with finalising {rec.peak_rss_mib:.0f} MiB")


if __name__ == "__main__":
    main()
