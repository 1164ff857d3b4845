"""`trainbpf record` for the benchmarks: the same library call the CLI makes, plus a line
"attached" on stdout once the probes are live (so the benchmark releases its workload
only then) and the result as one JSON line at the end.  Stops on SIGINT or when the
target exits."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainbpf.tracer.record import record
from trainbpf.tracer.record_config import RecordConfig
from trainbpf.tracer.settings import Settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--settings", default="{}", help="Settings fields as JSON")
    ap.add_argument("--probes", default="")
    ap.add_argument("--duration", type=float)
    args = ap.parse_args()

    def attached() -> None:
        print("attached", flush=True)

    config = RecordConfig(pid=args.pid, output=args.output, duration=args.duration,
                          settings=Settings(**json.loads(args.settings)),
                          probes=tuple(p for p in args.probes.split(",") if p) or None,
                          gpu="off", force=True)  # benchmarks record into the same scratch file run after run
    result = record(config=config, on_attached=attached)
    print(json.dumps({"rows": result.rows, "lost": result.lost, "duration_s": result.duration_s,
                      "bytes": result.bytes, "stop_reason": result.stop_reason,
                      "threads": result.threads, "faults": _meta(args.output).get("faults")}), flush=True)


def _meta(path: str) -> dict:
    """The trace's metadata (what a revision without some key simply lacks)."""
    import pyarrow.parquet as pq

    from trainbpf.trace.meta import decode_meta

    return decode_meta(pq.read_schema(path).metadata, Path(path))


if __name__ == "__main__":
    sys.exit(main())
