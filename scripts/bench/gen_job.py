"""Synthetic traces of one multi-node job, one trace per node, for bench_job.py and the
tests: built with numpy and written the way the recorder writes (stored_batch ->
SpoolWriter -> finalize).

The job: `world` ranks under torchrun, each rank a process with a trainer thread, two
gloo threads, two DataLoader worker processes and idle helper threads.  Every step each
rank launches its work (running), waits for its GPU (a sleep nobody ends; its GPU busy
meanwhile) and all-reduces (a futex wait its gloo thread ends once the last rank
arrived).  Step lengths are random (irregular, so a clock one step off never lines up),
and one rank is late by 20-30 ms in most steps, waiting for its DataLoader worker to
decode a batch.  Times are planned on the wall clock once for the whole job; each trace
holds its own ranks in its own node's CLOCK_MONOTONIC, with `wall_minus_mono_ns` in its
metadata (plus an error, to test alignment) and `process_env` rows naming the ranks.
Every trace uses the same pids, as separate machines may.

    python gen_job.py OUT_DIR [--traces 2] [--ranks-per-trace 4] [--seconds 10]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainbpf.trace.schema import SCHEMA_ID
from trainbpf.trace.spool import SpoolWriter, finalize, spool_path_for, stored_batch

MS = 1_000_000
NS = 1_000_000_000
START_WALL_NS = 1_700_000_000 * NS
LAUNCHER_PID = 1000
RUN_ID = "synthetic-job"
FUTEX_STACK = "futex_wait_queue;futex_wait;do_futex;__x64_sys_futex"
FUTEX_ADDR = 0x7F00_0000_1000


@dataclass
class Job:
    """The job on the wall clock: per step (rows) and rank (columns) when its step
    began, how long it waited for its data and ran launching work, when its GPU work
    ended (its arrival at the all-reduce) and when it left the all-reduce."""

    start: np.ndarray
    data_ns: np.ndarray
    launch_ns: np.ndarray
    arrive: np.ndarray
    leave: np.ndarray
    seconds: float
    slow_rank: int

    @property
    def world(self) -> int:
        return self.arrive.shape[1]


def plan_job(world: int, seconds: float, *, slow_rank: int = 1, lag_ms: tuple[float, float] = (20.0, 30.0),
             late_share: float = 0.9, seed: int = 0) -> Job:
    """Steps of about 100 ms (launch 10-20 ms, GPU work 40-100 ms, both random per step)
    until `seconds`; `slow_rank` waits `lag_ms` for its data in `late_share` of them."""
    rng = np.random.default_rng(seed)
    n = int(seconds / 0.08) + 2
    launch = rng.uniform(10, 20, n)[:, None] * MS + rng.uniform(0, 0.5, (n, world)) * MS
    gpu = rng.uniform(40, 100, n)[:, None] * MS + rng.uniform(0, 0.5, (n, world)) * MS
    data = np.zeros((n, world))
    if 0 <= slow_rank < world:
        data[:, slow_rank] = np.where(rng.random(n) < late_share, rng.uniform(*lag_ms, n) * MS, 0.0)
    start = np.zeros((n, world), np.int64)
    arrive = np.zeros((n, world), np.int64)
    leave = np.zeros((n, world), np.int64)
    begin = np.full(world, START_WALL_NS, np.int64)
    for k in range(n):
        start[k] = begin
        arrive[k] = begin + (data[k] + launch[k] + gpu[k]).astype(np.int64)
        done = arrive[k].max() + int(rng.uniform(0.3, 0.6) * MS)  # the all-reduce's own time
        leave[k] = done + (rng.uniform(0, 0.15, world) * MS).astype(np.int64)  # each rank's wake-up
        begin = leave[k]
    keep = leave.max(axis=1) < START_WALL_NS + int(seconds * NS)
    return Job(start=start[keep], data_ns=data[keep].astype(np.int64), launch_ns=launch[keep].astype(np.int64),
               arrive=arrive[keep], leave=leave[keep], seconds=seconds, slow_rank=slow_rank)


class _Rows:
    """Batches of rows; a column given one value repeats it on every row."""

    def __init__(self):
        self.batches: list = []

    def add(self, kind: str, **columns) -> None:
        n = max(len(v) if isinstance(v, (list, np.ndarray)) else 1 for v in columns.values())
        if n:
            self.batches.append(stored_batch(kind, {name: value if isinstance(value, (list, np.ndarray)) else [value] * n
                                                  for name, value in columns.items()}))


def _offcpu(rows: _Rows, ts, dur, tid: int, pid: int, *, waker=None, futex: bool = False, cpu: int = 0) -> None:
    ts, dur = np.asarray(ts, np.int64), np.asarray(dur, np.int64)
    keep = dur > 0
    ts, dur = ts[keep], dur[keep]
    if not len(ts):
        return
    peer = np.full(len(ts), -1 if waker is None else waker, np.int64)
    rows.add("offcpu", ts_ns=ts, dur_ns=dur, tid=tid, pid=pid, cpu=cpu, state="S", runq_ns=np.int64(20_000),
             peer_tid=np.where(peer >= 0, peer, None), kstack_id=np.int32(1 if futex else 2))
    if futex:
        rows.add("futex", ts_ns=ts + 1_000, dur_ns=dur - 2_000, tid=tid, pid=pid, addr=np.uint64(FUTEX_ADDR),
                 op=np.int32(128 + 9))


def _rank_rows(rows: _Rows, job: Job, rank: int, local: int, pids: dict[str, int], mono, window, rng) -> None:
    """One rank's processes and threads over the trace's `window` (mono ns)."""
    lo, hi = window
    trainer, gloo, workers, helpers = pids["trainer"], pids["gloo"], pids["workers"], pids["helpers"]
    inside = (mono(job.leave[:, rank]) > lo) & (mono(job.start[:, rank]) < hi)
    start, leave = mono(job.start[inside, rank]), mono(job.leave[inside, rank])
    arrive = mono(job.arrive[inside, rank])
    data, launch = job.data_ns[inside, rank], job.launch_ns[inside, rank]
    # The trainer: its data wait (ended by its first worker), GPU wait, all-reduce wait.
    _offcpu(rows, start, data, trainer, trainer, waker=workers[0], futex=True, cpu=local % 2)
    gpu_from = start + data + launch
    _offcpu(rows, gpu_from, arrive - gpu_from, trainer, trainer, cpu=local % 2)
    _offcpu(rows, arrive, leave - arrive, trainer, trainer, waker=gloo[0], futex=True, cpu=local % 2)
    on = np.concatenate([np.arange(a, a + n, NS // 199) for a, n in zip(start + data, launch)]) if len(start) else []
    rows.add("oncpu", ts_ns=np.asarray(on, np.int64), tid=trainer, pid=trainer, cpu=np.int32(local % 2),
             ustack_id=np.int32(3))
    # gloo: its loop thread sleeps between all-reduces; the other one barely runs.
    prev = np.concatenate([[lo], leave[:-1]])
    _offcpu(rows, prev + 50_000, leave - 100_000 - prev - 50_000, gloo[0], trainer)
    _offcpu(rows, [lo], [hi - lo - MS], gloo[1], trainer)
    # The first worker decodes while the late rank waits for it; the others sleep most of the step.
    busy = np.where(data > 0, data, (rng.uniform(2, 6, len(start)) * MS).astype(np.int64))
    _offcpu(rows, start + busy, leave - start - busy, workers[0], workers[0], waker=trainer, futex=True)
    for w in workers[1:]:
        _offcpu(rows, start, leave - start - 5 * MS, w, w, waker=trainer, futex=True)
    for h in helpers:
        ticks = np.arange(lo, hi - NS // 2, NS // 2, dtype=np.int64)
        _offcpu(rows, ticks, np.full(len(ticks), NS // 2 - 200_000), h, trainer)
    short = np.arange(lo + NS, hi, NS, dtype=np.int64)
    for tid, pid in [(trainer, trainer), (gloo[0], trainer)] + [(w, w) for w in workers]:
        rows.add("offcpu_short", ts_ns=short, dur_ns=np.int64(4 * MS), tid=tid, pid=pid, state="S",
                 count=np.int64(400), runq_ns=np.int64(MS))


def _gpu_rows(rows: _Rows, job: Job, ranks: list[int], local: list[int], host: str, mono, window) -> None:
    """Each rank's GPU at 10 Hz: busy while its rank waits for it."""
    lo, hi = window
    ts = np.arange(lo + NS // 10, hi, NS // 10, dtype=np.int64)
    for rank, index in zip(ranks, local):
        begin = mono(job.start[:, rank] + job.data_ns[:, rank] + job.launch_ns[:, rank])
        end = mono(job.arrive[:, rank])
        covered = np.concatenate([[0], np.cumsum(end - begin)])

        def busy(t):
            at = np.searchsorted(begin, t, side="right")
            return covered[at] - np.clip(end[np.maximum(at - 1, 0)] - t, 0, None) * (at > 0)

        util = 95.0 * (busy(ts) - busy(ts - NS // 10)) / (NS // 10)
        rows.add("gpu", ts_ns=ts, op=np.int32(index), value=np.clip(util, 0, 100), count=np.int64(4000),
                 size=np.int64(20), name=f"GPU-{host}-{index:02d}")


def write_trace(path: Path, job: Job, ranks: list[int], *, host: str, boot_s: float, clock_error_ns: int = 0,
                start_s: float = 0.0, helpers: int = 6, seed: int = 0, env: bool = True, run_id: str = RUN_ID,
                containers: bool = False) -> Path:
    """One node's trace of `ranks` (global rank numbers, local ranks in order): its
    CLOCK_MONOTONIC read `boot_s` at the job's wall-clock start, its metadata's
    wall_minus_mono_ns off by `clock_error_ns`, its recording from `start_s` on;
    `env`: whether the ranks' environments are recorded (process_env rows); `containers`:
    whether each rank ran in a container of its own (container rows: container_id)."""
    rng = np.random.default_rng(seed)
    wall_minus_mono = START_WALL_NS - int(boot_s * NS)

    def mono(wall):
        return np.asarray(wall, np.int64) - wall_minus_mono

    lo = int(mono(START_WALL_NS + int(start_s * NS)))
    hi = int(mono(START_WALL_NS + int(job.seconds * NS)))
    rows, threads = _Rows(), []
    threads += [(LAUNCHER_PID, LAUNCHER_PID, "torchrun", 1), (LAUNCHER_PID + 1, LAUNCHER_PID, "pt_elastic", None)]
    next_id = LAUNCHER_PID + 10
    for local, rank in enumerate(ranks):
        trainer = next_id
        pids = {"trainer": trainer, "gloo": [trainer + 1, trainer + 2], "workers": [trainer + 3, trainer + 4],
                "helpers": list(range(trainer + 5, trainer + 5 + helpers))}
        next_id += 10 + helpers
        threads += [(trainer, trainer, "python3", LAUNCHER_PID), (trainer + 1, trainer, "pt_gloo_runloop", None),
                    (trainer + 2, trainer, "gloo_tcp_loop", None)]
        threads += [(w, w, "pt_data_worker", trainer) for w in pids["workers"]]
        threads += [(h, trainer, "python3", None) for h in pids["helpers"]]
        if env:
            variables = {"RANK": rank, "LOCAL_RANK": local, "WORLD_SIZE": job.world, "TORCHELASTIC_RUN_ID": run_id,
                         "MASTER_ADDR": "10.200.0.1", "MASTER_PORT": 29500}
            for pid in [trainer] + pids["workers"]:
                rows.add("process_env", ts_ns=np.int64(lo), pid=np.int32(pid), name=list(variables),
                         state=[str(v) for v in variables.values()])
        if containers:
            box = container_id(rank)
            fields = {"id": box, "runtime": "containerd", "cgroup": f"/kubepods/pod-rank{rank}/cri-containerd-{box}.scope"}
            for pid in [trainer] + pids["workers"]:
                rows.add("container", ts_ns=np.int64(lo), pid=np.int32(pid), name=list(fields), state=list(fields.values()))
        _rank_rows(rows, job, rank, local, pids, mono, (lo, hi), rng)
    _offcpu(rows, [lo], [hi - lo - MS], LAUNCHER_PID, LAUNCHER_PID)
    _offcpu(rows, np.arange(lo, hi - NS, NS), np.full(len(range(lo, hi - NS, NS)), NS - MS), LAUNCHER_PID + 1, LAUNCHER_PID)
    _gpu_rows(rows, job, ranks, list(range(len(ranks))), host, mono, (lo, hi))
    tid, pid, comm, parent = zip(*threads)
    rows.add("thread", ts_ns=np.int64(lo), tid=np.array(tid, np.int32), pid=np.array(pid, np.int32), comm=list(comm),
             peer_tid=np.array([p if p is not None else None for p in parent], dtype=object), name="seed")
    rows.add("stack", ts_ns=np.int64(lo), kstack_id=np.array([1, 2, 3], np.int32), state=["kernel", "kernel", "user"],
             pid=np.array([0, 0, LAUNCHER_PID], np.int32),
             name=[FUTEX_STACK, "do_nanosleep;hrtimer_nanosleep;__x64_sys_clock_nanosleep",
                   "sgemm_kernel [libtorch_cpu.so];_PyEval_EvalFrameDefault [python3.11]"])
    meta = {
        "schema": SCHEMA_ID, "host": host, "kernel": "6.18.0-synthetic", "argv": ["trainbpf", "record", "--pid", str(LAUNCHER_PID)],
        "target_pid": LAUNCHER_PID, "target_cmdline": ["torchrun", "train.py"], "trainer_tid": None,
        "clock": {"start_mono_ns": lo, "end_mono_ns": hi, "wall_minus_mono_ns": wall_minus_mono + clock_error_ns,
                  "source": "CLOCK_MONOTONIC"},
        "topology": {"nodes": {"0": [0, 1]}, "gpus": [], "gpu_node": None, "declared": False},
        "probes": ["sched", "futex", "faults", "oncpu", "mm", "writeback", "block"],
        "thresholds": {"min_block_ns": 20_000, "min_futex_ns": 20_000, "oncpu_hz": 199, "fault_bucket_ns": 100_000_000,
                       "hz": 250},
        "gpu": {"source": "nvidia-smi", "samples": 0}, "lost": {}, "complete": True, "stop_reason": "duration",
    }
    writer = SpoolWriter(Path(path), meta)
    for batch in rows.batches:
        writer.add(batch)
    writer.flush()
    writer.close()
    return finalize(spool_path_for(Path(path)), Path(path))


def container_id(rank: int) -> str:
    """The id of rank `rank`'s container, where write_trace gives each its own."""
    return format(0xC0FFEE00 + rank, "064x")


def write_job(folder: Path, *, traces: int = 2, ranks_per_trace: int = 4, seconds: float = 10.0, slow_rank: int = 1,
              clock_errors_ms: list[float] | None = None, helpers: int = 6, seed: int = 0, env: bool = True,
              containers: bool = False) -> list[Path]:
    """`traces` node traces of one job of traces x ranks_per_trace ranks (node i holds
    ranks i*ranks_per_trace ...); node i's clock booted 1000 + 37 i s before the job and
    its recording starts 50 i ms into it; `clock_errors_ms`: each trace's metadata error
    (default: 0 for the first, then a little, as NTP leaves it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    job = plan_job(traces * ranks_per_trace, seconds, slow_rank=slow_rank, seed=seed)
    errors = clock_errors_ms if clock_errors_ms is not None else [0.0] + [0.8 * (-1) ** i for i in range(1, traces)]
    paths = []
    for i in range(traces):
        ranks = list(range(i * ranks_per_trace, (i + 1) * ranks_per_trace))
        paths.append(write_trace(folder / f"node{i}.parquet", job, ranks, host=f"node{i}", boot_s=1000 + 37 * i,
                                 clock_error_ns=int(errors[i] * MS), start_s=0.05 * i, helpers=helpers, seed=seed + i,
                                 env=env, containers=containers))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path, help="folder to write node0.parquet ... into")
    ap.add_argument("--traces", type=int, default=2)
    ap.add_argument("--ranks-per-trace", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--slow-rank", type=int, default=1)
    args = ap.parse_args()
    for path in write_job(args.output, traces=args.traces, ranks_per_trace=args.ranks_per_trace, seconds=args.seconds,
                          slow_rank=args.slow_rank):
        print(path)


if __name__ == "__main__":
    main()
