#!/usr/bin/env python3
"""Check trainbpf's GPU inputs on a real GPU node, without BPF: run a short real PyTorch
training job whose steps interleave a data wait and GPU work (tens of ms each), sample
the GPU through trainbpf's own nvidia-smi reader and NVML source while it runs, and set
what they saw beside what the job measured itself (CUDA events for GPU busy time,
its own clock for the data waits).  Also lists the CUDA libraries the job mapped and the
probed calls they export, as `record` would find them.

    python3 scripts/gpu_check.py --seconds 8 --out DIR

DIR gets summary.json, the raw nvidia-smi lines (nvidia-smi.csv, a parser fixture) and
the job's per-step truth (steps.csv).  Needs torch with CUDA, nvidia-smi and/or NVML."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

TRAINER = r'''
import os, sys, time, torch
from torch.utils.data import DataLoader, IterableDataset

class Decode(IterableDataset):
    """Each batch costs `decode_ms` of CPU in a worker: the data the trainer waits on."""
    def __init__(self, decode_ms): self.decode_ms = decode_ms
    def __iter__(self):
        while True:
            end = time.perf_counter() + self.decode_ms / 1000
            x = 0
            while time.perf_counter() < end:
                x += 1
            yield torch.randn(256, 4096)

seconds, decode_ms, gpu_ms, out = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
dev = torch.device("cuda")
w = torch.randn(4096, 4096, device=dev)
# size one step's matrix products to about gpu_ms
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): a @ a
torch.cuda.synchronize(); per = (time.perf_counter() - t) / 10
reps = max(1, round(gpu_ms / 1000 / per))
loader = iter(DataLoader(Decode(decode_ms), batch_size=None, num_workers=1, prefetch_factor=1))
next(loader)
rows = []
print("ready", os.getpid(), flush=True)
start = time.perf_counter()
while time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    batch = next(loader)
    t1 = time.perf_counter()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    x = batch.to(dev, non_blocking=False) @ w
    for _ in range(reps): a @ a
    e1.record()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    rows.append((time.monotonic_ns(), (t1 - t0) * 1e3, e0.elapsed_time(e1), (t2 - t0) * 1e3))
with open(out, "w") as fh:
    fh.write("end_mono_ns,data_wait_ms,gpu_busy_ms,step_ms\n")
    fh.writelines(f"{a},{b:.3f},{c:.3f},{d:.3f}\n" for a, b, c, d in rows)
print("done", len(rows), flush=True)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--decode-ms", type=float, default=30.0)
    ap.add_argument("--gpu-ms", type=float, default=30.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from trainbpf.tracer.collectors import cuda
    from trainbpf.tracer.samplers.gpu import QUERY, GpuSampler

    summary: dict = {"host": os.uname().nodename, "kernel": os.uname().release}
    smi = shutil.which("nvidia-smi")
    raw = None
    if smi:
        raw = subprocess.Popen([smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=open(args.out / "nvidia-smi.csv", "w"), stderr=subprocess.DEVNULL)
    samplers = {m: GpuSampler(mode=m) for m in ("nvidia-smi", "nvml")}
    for s in samplers.values():
        s.start()
    steps_csv = args.out / "steps.csv"
    job = subprocess.Popen([sys.executable, "-c", TRAINER, str(args.seconds), str(args.decode_ms),
                            str(args.gpu_ms), str(steps_csv)], stdout=subprocess.PIPE, text=True)
    assert job.stdout
    first = job.stdout.readline().split()
    t_start = time.monotonic_ns()
    libs = []
    if first[:1] == ["ready"]:
        pid = int(first[1])
        time.sleep(1.0)
        maps = Path(f"/proc/{pid}/maps").read_text()
        for path, _file in cuda.cuda_libraries(maps):
            libs.append({"path": path, "probed_calls": _exported(path)})
    rest = job.communicate(timeout=args.seconds + 120)[0]
    t_end = time.monotonic_ns()
    for s in samplers.values():
        s.stop()
    if raw:
        raw.terminate()
    summary["job"] = {"first_line": " ".join(first), "rest": rest.strip(), "rc": job.returncode}
    summary["cuda_libraries"] = libs

    truth = _truth(steps_csv, t_start, t_end)
    summary["truth"] = truth
    for mode, s in samplers.items():
        batch = s.take()
        rows = batch.to_pydict() if batch is not None else None
        summary[mode] = _sampled(rows, truth.get("window")) if rows else {"source": s.source, "samples": 0}
        summary[mode]["meta"] = s.meta()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


def _exported(path: str) -> list[str]:
    """The probed calls the library exports (nm -D; the recorder reads them through bcc)."""
    nm = shutil.which("nm")
    if not nm:
        return ["(no nm)"]
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True).stdout
    pat = re.compile(cuda.SYMBOL_RE)
    return sorted({line.split()[-1] for line in out.splitlines() if line.split() and pat.match(line.split()[-1])})


def _truth(steps_csv: Path, t_start: int, t_end: int) -> dict:
    if not steps_csv.exists():
        return {}
    lines = steps_csv.read_text().splitlines()[1:]
    rows = [tuple(float(v) for v in ln.split(",")) for ln in lines]
    if not rows:
        return {}
    # the steady part: skip the first and last second
    lo, hi = rows[0][0] - rows[0][3] * 1e6 + 1e9, rows[-1][0] - 1e9
    keep = [r for r in rows if lo <= r[0] - r[3] * 1e6 and r[0] <= hi]
    span_ms = sum(r[3] for r in keep)
    return {"steps": len(rows), "steady_steps": len(keep), "window": [lo, hi],
            "step_ms_mean": span_ms / max(1, len(keep)),
            "data_wait_ms_mean": sum(r[1] for r in keep) / max(1, len(keep)),
            "gpu_busy_ms_mean": sum(r[2] for r in keep) / max(1, len(keep)),
            "gpu_busy_fraction": sum(r[2] for r in keep) / span_ms if span_ms else None}


def _sampled(rows: dict, window) -> dict:
    pts = [(ts, u, pid) for ts, u, pid in zip(rows["ts_ns"], rows["value"], rows["pid"])]
    dev = [(ts, u) for ts, u, pid in pts if pid is None]
    inside = [u for ts, u in dev if window and window[0] <= ts <= window[1]]
    gaps = [b[0] - a[0] for a, b in zip(dev, dev[1:])]
    return {"samples": len(dev), "process_rows": len(pts) - len(dev), "steady_samples": len(inside),
            "util_mean_pct": sum(inside) / len(inside) if inside else None,
            "util_min_pct": min(inside) if inside else None, "util_max_pct": max(inside) if inside else None,
            "spacing_ms_median": sorted(gaps)[len(gaps) // 2] / 1e6 if gaps else None,
            "durations_ms": sorted({round(d / 1e6, 1) for d in rows["dur_ns"] if d})[:8],
            "first_values": [u for _, u in dev[:30]]}


if __name__ == "__main__":
    sys.exit(main())
