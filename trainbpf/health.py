"""`trainbpf health`: a short, scheduled check of one node, for cron, a systemd timer or
a Slurm prolog on every training node; the fleet view is the site's Prometheus.

One run takes a lock (an overlapping run skips), chooses targets (the given pids, else
processes holding a GPU device file open or whose command line matches a launcher
pattern), records one short trace (the targets' common process tree, or the whole
machine when there is no target or the targets share no tree), analyses it per target
(`trainbpf analyze`'s JSON contract) and for the node (run-queue latency, reclaim, dirty
throttling, PSI, NUMA), grades every value against warning/critical thresholds and writes
a Prometheus textfile and a JSON document, each atomically.  The status is the exit
code: 0 ok, 1 warning, 2 critical, 3 could not check.  A hard time limit bounds the run;
probes never outlive it (bcc detaches them in the recorder's `finally`, and the kernel
drops whatever a killed process still held).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.gpu import gpu_utilisation, idle_fraction
from trainbpf.analyzers.intervals import trace_span
from trainbpf.errors import NotRootError, OutputError, TargetError, TrainbpfError, UsageError
from trainbpf.safefile import check_output, write_new

HEALTH_SCHEMA = "trainbpf.health/1"
OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
STATUS_NAMES = {OK: "ok", WARNING: "warning", CRITICAL: "critical", UNKNOWN: "unknown"}

DEFAULT_CONFIG_PATH = Path("/etc/trainbpf/health.toml")
TEXTFILE_NAME = "trainbpf_health.prom"
# The hard backstop fires this long after the time limit when the soft stop did not
# end the run (the main thread stuck where signals cannot reach it, e.g. a compile).
BACKSTOP_GRACE_S = 10.0
PROC = Path("/proc")


class HealthBusy(TrainbpfError):
    """Another health check holds the lock."""

    exit_code = UNKNOWN


class CheckTimeout(TrainbpfError):
    exit_code = UNKNOWN


class CheckInterrupted(TrainbpfError):
    exit_code = UNKNOWN


# -- configuration -----------------------------------------------------------------------

@dataclass(frozen=True)
class Threshold:
    """A value at or above `warning` warns, at or above `critical` is critical; inf
    turns a level off."""

    warning: float
    critical: float


# Every graded value, with its default levels.  Node values cover the traced threads
# (the targets' tree, or every thread without targets); PSI and NUMA are machine-wide.
DEFAULT_THRESHOLDS: dict[str, Threshold] = {
    "starved_ratio": Threshold(0.2, 0.4),  # a GPU idle 40% of the time for its own trainer's stalls is critical
    "runqueue_latency_p99_seconds": Threshold(0.01, 0.05),
    "reclaim_ratio": Threshold(0.01, 0.05),
    "dirty_throttle_ratio": Threshold(0.01, 0.05),
    "cpu_pressure_ratio": Threshold(0.5, 0.9),
    "memory_pressure_ratio": Threshold(0.05, 0.2),
    "io_pressure_ratio": Threshold(0.25, 0.5),
    "numa_remote_ratio": Threshold(0.1, 0.3),
    "lost_event_ratio": Threshold(0.01, math.inf),
}
TARGET_CHECKS = ("starved_ratio",)
NODE_CHECKS = tuple(k for k in DEFAULT_THRESHOLDS if k not in TARGET_CHECKS)

# The stall category (DESIGN §4) a failing node check points at.
CHECK_CATEGORY = {
    "runqueue_latency_p99_seconds": "cpu_contention",
    "reclaim_ratio": "memory_reclaim",
    "dirty_throttle_ratio": "dirty_throttling",
    "cpu_pressure_ratio": "cpu_contention",
    "memory_pressure_ratio": "memory_reclaim",
    "io_pressure_ratio": "block_io",
    "numa_remote_ratio": "numa_remote",
}

DEFAULT_COMMAND_PATTERNS = (r"\btorchrun\b", r"\btorch\.distributed\.(run|launch)\b", r"\bdeepspeed\b", r"\baccelerate launch\b")
# Daemons that hold GPU device files open without training anything.
DEFAULT_EXCLUDE_PATTERNS = (r"nvidia-persistenced", r"nv-hostengine", r"dcgm", r"nvidia-smi", r"\bXorg\b", r"gdm|gnome-shell")
GPU_MODES = ("auto", "nvml", "nvidia-smi", "off")


@dataclass(frozen=True)
class HealthConfig:
    duration_s: float = 10.0
    time_limit_s: float | None = None  # None: duration_s + 60
    lock_file: Path = Path("/run/trainbpf-health.lock")
    textfile_dir: Path | None = None
    json_file: Path | None = None
    trace_file: Path | None = None  # keep the trace here; None: a temporary file, removed
    gpu: str = "auto"
    device_glob: str = "/dev/nvidia*"
    command_patterns: tuple[str, ...] = DEFAULT_COMMAND_PATTERNS
    exclude_patterns: tuple[str, ...] = DEFAULT_EXCLUDE_PATTERNS
    pids: tuple[int, ...] = ()
    thresholds: Mapping[str, Threshold] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))

    @property
    def limit_s(self) -> float:
        return self.time_limit_s if self.time_limit_s is not None else self.duration_s + 60.0


MAX_SECONDS = 86_400  # a health check records for seconds; a day is surely a typo
_PATH_KEYS = ("lock_file", "textfile_dir", "json_file", "trace_file")
_NUMBER_KEYS = ("duration_s", "time_limit_s")
# Keys older configurations may hold that no longer mean anything: accepted and ignored
# (starved time stopped depending on a GPU idle threshold), so a fleet's configs keep working.
_RETIRED_KEYS = ("gpu_idle_threshold",)
_PATTERN_KEYS = ("command_patterns", "exclude_patterns")
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(HealthConfig) if f.name != "pids")


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise UsageError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _thresholds(where: str, table: Any) -> dict[str, Threshold]:
    if not isinstance(table, dict):
        raise UsageError(f"{where}: expected a table of {{ warning = N, critical = N }}")
    out = dict(DEFAULT_THRESHOLDS)
    for name, levels in table.items():
        if name not in DEFAULT_THRESHOLDS:
            raise UsageError(f"{where}.{name}: unknown threshold (known: {', '.join(DEFAULT_THRESHOLDS)})")
        if not isinstance(levels, dict) or not set(levels) <= {"warning", "critical"}:
            raise UsageError(f"{where}.{name}: expected {{ warning = N, critical = N }}")
        base = DEFAULT_THRESHOLDS[name]
        th = Threshold(_number(f"{where}.{name}.warning", levels.get("warning", base.warning)),
                       _number(f"{where}.{name}.critical", levels.get("critical", base.critical)))
        if th.warning < 0 or th.critical < 0:
            raise UsageError(f"{where}.{name}: thresholds are not negative, got {th.warning}/{th.critical}")
        if th.warning > th.critical:
            raise UsageError(f"{where}.{name}: warning {th.warning} is above critical {th.critical}")
        out[name] = th
    return out


def config_from_mapping(raw: Mapping[str, Any], *, source: str) -> HealthConfig:
    """A validated HealthConfig from a parsed TOML document; UsageError names the key."""
    values: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{source}: {key}"
        if key in _RETIRED_KEYS:
            continue
        if key not in CONFIG_KEYS:
            raise UsageError(f"{where}: unknown key (known: {', '.join(CONFIG_KEYS)})")
        if key in _NUMBER_KEYS:
            values[key] = _number(where, value)
        elif key in _PATH_KEYS:
            if not isinstance(value, str) or not value:
                raise UsageError(f"{where}: expected a path")
            values[key] = Path(value)
        elif key in _PATTERN_KEYS:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UsageError(f"{where}: expected a list of regular expressions")
            values[key] = tuple(value)
        elif key == "thresholds":
            values[key] = _thresholds(f"{source}: thresholds", value)
        elif not isinstance(value, str):
            raise UsageError(f"{where}: expected a string")
        else:
            values[key] = value
    return validate_config(HealthConfig(**values), source=source)


def validate_config(config: HealthConfig, *, source: str = "health") -> HealthConfig:
    if not 0 < config.duration_s <= MAX_SECONDS:
        raise UsageError(f"{source}: duration_s must be positive and at most {MAX_SECONDS} s, got {config.duration_s}")
    if not 0 < config.limit_s <= MAX_SECONDS + 60:
        raise UsageError(f"{source}: time_limit_s must be positive and at most {MAX_SECONDS + 60} s, "
                         f"got {config.time_limit_s}")
    if config.gpu not in GPU_MODES:
        raise UsageError(f"{source}: gpu {config.gpu!r}: choose {', '.join(GPU_MODES)}")
    for key in _PATTERN_KEYS:
        for pattern in getattr(config, key):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(f"{source}: {key}: bad regular expression {pattern!r} ({exc})") from None
    for pid in config.pids:
        if pid <= 0:
            raise UsageError(f"--pid {pid}: a process id is positive")
    return config


def load_config(path: Path | None) -> HealthConfig:
    """The config at `path`; without one, DEFAULT_CONFIG_PATH when it exists, else the
    defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return HealthConfig()
        path = DEFAULT_CONFIG_PATH
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config {path}: not valid TOML ({exc})") from None
    return config_from_mapping(raw, source=f"config {path}")


def health_config(*, config_file: Path | None, duration: float | None = None, pids: list[int] | None = None,
                  textfile_dir: Path | None = None, json_file: Path | None = None) -> HealthConfig:
    """The config file's settings with the command line's on top."""
    config = load_config(config_file)
    overrides: dict[str, Any] = {}
    if duration is not None:
        overrides["duration_s"] = float(duration)
    if pids:
        overrides["pids"] = tuple(int(p) for p in pids)
    if textfile_dir is not None:
        overrides["textfile_dir"] = Path(textfile_dir)
    if json_file is not None:
        overrides["json_file"] = Path(json_file)
    return validate_config(dataclasses.replace(config, **overrides), source="command line")


# -- target selection --------------------------------------------------------------------

@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    comm: str
    cmdline: str  # argv joined by spaces; "" for kernel threads
    holds_device: bool = False


@dataclass(frozen=True)
class Target:
    pid: int
    comm: str
    cmdline: str
    reason: str  # "pid" (given), "device" (holds a device file), "pattern" (command matched)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _holds_any(pid: int, devices: set[str], proc: Path) -> bool:
    try:
        fds = os.listdir(proc / str(pid) / "fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(proc / str(pid) / "fd" / fd) in devices:
                return True
        except OSError:
            continue
    return False


def scan_processes(*, device_glob: str, proc: Path = PROC) -> dict[int, Process]:
    """Every live process: parent, name, command line, and whether it holds a file that
    `device_glob` names open (a GPU: /dev/nvidia0, /dev/nvidiactl, ...)."""
    devices = {os.path.realpath(p) for p in glob.glob(device_glob)}
    out: dict[int, Process] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _read_text(proc / entry.name / "stat")
        if stat is None or ")" not in stat:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):
            continue
        raw = _read_text(proc / entry.name / "cmdline") or ""
        cmdline = " ".join(a for a in raw.split("\0") if a)
        out[pid] = Process(pid, int(fields[1]), comm, cmdline, bool(devices) and _holds_any(pid, devices, proc))
    return out


def ancestry(processes: Mapping[int, Process], pid: int) -> list[int]:
    """`pid`, its parent, ... up to the first process not in `processes`."""
    chain: list[int] = []
    while pid in processes and pid not in chain:
        chain.append(pid)
        pid = processes[pid].ppid
    return chain


def _target(p: Process, reason: str) -> Target:
    return Target(p.pid, p.comm, p.cmdline, reason)


def choose_targets(processes: Mapping[int, Process], *, command_patterns: tuple[str, ...],
                   exclude_patterns: tuple[str, ...], skip: set[int]) -> list[Target]:
    """The training processes among `processes`.

    Device holders come first; a forked child (a DataLoader worker) inherits its parent's
    device files, so only the topmost holder of a tree counts.  A command-pattern match
    counts when no device holder lies in its tree (a launcher is represented by the
    ranks it started) and no other match is above it."""
    include = [re.compile(p) for p in command_patterns]
    exclude = [re.compile(p) for p in exclude_patterns]

    def eligible(p: Process) -> bool:
        return p.pid not in skip and bool(p.cmdline) and not any(rx.search(p.cmdline) for rx in exclude)

    candidates = [p for p in processes.values() if eligible(p)]
    holders = {p.pid for p in candidates if p.holds_device}
    matched = {p.pid for p in candidates if p.pid not in holders and any(rx.search(p.cmdline) for rx in include)}
    above = {pid: set(ancestry(processes, pid)[1:]) for pid in holders | matched}
    ranks = {pid for pid in holders if not above[pid] & holders}
    under_rank = {a for r in ranks for a in above[r]}
    launchers = {pid for pid in matched if not above[pid] & (matched | holders) and pid not in under_rank}
    return [_target(processes[pid], "device") for pid in sorted(ranks)] + \
        [_target(processes[pid], "pattern") for pid in sorted(launchers)]


def given_targets(processes: Mapping[int, Process], pids: tuple[int, ...]) -> list[Target]:
    missing = [p for p in pids if p not in processes]
    if missing:
        raise TargetError(f"no such process: {', '.join(map(str, missing))} (--pid takes a process id, the kernel's tgid)")
    return [_target(processes[p], "pid") for p in dict.fromkeys(pids)]


def recording_root(processes: Mapping[int, Process], pids: list[int]) -> int | None:
    """The deepest process whose tree holds every pid; None (trace the whole machine)
    when there is none below init."""
    if not pids:
        return None
    chains = [ancestry(processes, p) for p in pids]
    common = set(chains[0]).intersection(*map(set, chains[1:]))
    root = next((p for p in chains[0] if p in common), None)
    return root if root is not None and root > 1 else None


def tree_pids(processes: Mapping[int, Process], pid: int) -> set[int]:
    """`pid` and its descendant processes."""
    kids: dict[int, list[int]] = {}
    for p in processes.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(kids.get(p, []))
    return out


def _tids_of(pids: set[int], proc: Path = PROC) -> set[int]:
    tids = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            tids.update(int(t) for t in os.listdir(proc / str(pid) / "task"))
    return tids


# -- measurements ------------------------------------------------------------------------

def _as_float(values: Any) -> np.ndarray:
    return pd.to_numeric(pd.Series(values), errors="coerce").fillna(0).to_numpy(np.float64)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][min(int(np.searchsorted(cum, q * cum[-1])), len(values) - 1)])


def node_metrics(trace: Any) -> dict[str, Any]:
    """Node-level values from a loaded trace (trainbpf.tracefile.Trace): run-queue
    latency and reclaim/compaction/dirty-throttling time of the traced threads, PSI and
    NUMA counters of the machine, GPU idle share, lost events."""
    recorded_s = trace.duration_ns / 1e9
    off, short = trace.frame("offcpu"), trace.frame("offcpu_short")
    # Long off-CPU intervals carry their own run-queue part; short ones are summed in
    # the kernel, so each sum stands for `count` waits of its mean length.
    short_count = _as_float(short["count"])
    short_runq = _as_float(short["runq_ns"])
    long_runq = _as_float(off["runq_ns"])
    values = np.concatenate([long_runq, np.divide(short_runq, short_count, out=np.zeros_like(short_runq), where=short_count > 0)])
    weights = np.concatenate([np.ones_like(long_runq), short_count])

    def total_s(kind: str) -> float:
        return float(_as_float(trace.frame(kind)["dur_ns"]).sum()) / 1e9

    psi = trace.frame("psi")
    pressure = {}
    for name, rows in psi.groupby("name"):
        span_us = _as_float(rows["dur_ns"]).sum() / 1e3
        if span_us > 0:
            pressure[str(name)] = min(1.0, float(_as_float(rows["count"]).sum() / span_us))

    vm = trace.frame("vmstat")
    vm_sum = pd.Series(_as_float(vm["count"]), index=vm["name"].astype(str)).groupby(level=0).sum() if len(vm) else pd.Series(dtype=float)
    local, other = float(vm_sum.get("numa_local", 0.0)), float(vm_sum.get("numa_other", 0.0))

    gpu = trace.frame("gpu")
    span = trace_span(trace.meta, trace.chunks(["ts_ns", "dur_ns"]))
    # gpu_utilisation takes the device's rows: rows with a pid are one process's share
    gpu_idle = {}
    for index, rows in gpu.groupby("op"):
        idle = idle_fraction(gpu_utilisation(rows, span), span)  # 1 - mean utilisation, time-weighted
        if idle is not None:
            gpu_idle[str(int(index))] = idle

    lost = int(sum(int(v) for v in (trace.meta.get("lost") or {}).values()))
    events = int(trace.num_rows)
    return {
        "recorded_seconds": recorded_s,
        "system_wide": bool(trace.meta.get("system_wide")),
        "runqueue_seconds": float(long_runq.sum() + short_runq.sum()) / 1e9,
        "runqueue_latency_p99_seconds": None if (q := weighted_quantile(values, weights, 0.99)) is None else q / 1e9,
        "runqueue_latency_max_seconds": float(long_runq.max()) / 1e9 if len(long_runq) else None,
        "reclaim_seconds": total_s("reclaim"),
        "compaction_seconds": total_s("compaction"),
        "dirty_throttle_seconds": total_s("dirty_pause"),
        "pressure": pressure,
        "numa_remote_ratio": other / (local + other) if local + other > 0 else None,
        "numa_pages_migrated": float(vm_sum.get("numa_pages_migrated", 0.0)),
        "numa_task_moves": int(len(trace.frame("numa_move"))),
        "gpu_idle_ratio": gpu_idle,
        "lost_events": lost,
        "lost_event_ratio": lost / (lost + events) if lost + events else 0.0,
    }


def node_check_values(node: Mapping[str, Any]) -> dict[str, float | None]:
    """What each node threshold is compared with."""
    recorded = node["recorded_seconds"]

    def per_second(seconds: float) -> float | None:
        return seconds / recorded if recorded > 0 else None

    pressure = node["pressure"]
    return {
        "runqueue_latency_p99_seconds": node["runqueue_latency_p99_seconds"],
        "reclaim_ratio": per_second(node["reclaim_seconds"]),
        "dirty_throttle_ratio": per_second(node["dirty_throttle_seconds"]),
        "cpu_pressure_ratio": pressure.get("cpu.some"),
        "memory_pressure_ratio": pressure.get("memory.some"),
        "io_pressure_ratio": pressure.get("io.some"),
        "numa_remote_ratio": node["numa_remote_ratio"],
        "lost_event_ratio": node["lost_event_ratio"],
    }


# -- grading -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str
    value: float | None
    threshold: Threshold
    status: int
    pid: int | None = None


def grade(value: float | None, threshold: Threshold) -> int:
    if value is None:
        return OK
    if value >= threshold.critical:
        return CRITICAL
    if value >= threshold.warning:
        return WARNING
    return OK


def make_check(name: str, value: float | None, thresholds: Mapping[str, Threshold], pid: int | None = None) -> Check:
    th = thresholds[name]
    return Check(name, value, th, grade(value, th), pid)


@dataclass
class TargetResult:
    target: Target
    status: int = UNKNOWN
    starved_s: float | None = None
    starved_ratio: float | None = None
    gpu_idle_fraction: float | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    role_seconds: dict[tuple[str, str], float] = field(default_factory=dict)  # (role, state) -> s
    error: str | None = None

    @property
    def top(self) -> dict[str, Any] | None:
        return self.findings[0] if self.findings else None


def analyze_target(*, trace_path: Path, target: Target, tids: set[int], thresholds: Mapping[str, Threshold]) -> TargetResult:
    """Grade one target from `trainbpf analyze`'s JSON report with the target's main
    thread as the trainer; `tids` are the threads of its process tree."""
    from trainbpf.report import run_analyze

    result = TargetResult(target)
    try:
        report = json.loads(run_analyze(path=trace_path, fmt="json", trainer_tid=target.pid))
    except TrainbpfError as exc:
        result.error = f"pid {target.pid}: {exc}"
        return result
    except Exception as exc:  # a crash in analysis is "could not check", never "healthy"
        result.error = f"pid {target.pid}: analysis failed ({type(exc).__name__}: {exc})"
        return result
    duration = float(report["trace"]["duration_s"] or 0.0)
    result.starved_s = float(report["starved_s"])
    result.starved_ratio = result.starved_s / duration if duration > 0 else None
    result.gpu_idle_fraction = report["gpu"]["idle_fraction"]
    result.findings = [{k: f[k] for k in ("category", "share", "seconds", "severity", "summary")} for f in report["findings"]]
    for th in report["threads"]:
        if th["tid"] in tids:
            for state, seconds in th["seconds"].items():
                key = (th["role"], state)
                result.role_seconds[key] = round(result.role_seconds.get(key, 0.0) + float(seconds), 6)
    result.status = make_check("starved_ratio", result.starved_ratio, thresholds, target.pid).status
    return result


@dataclass
class HealthResult:
    status: int
    host: str
    started: float  # unix time
    finished: float
    mode: str  # "targets" or "node"
    targets: list[TargetResult] = field(default_factory=list)
    node: dict[str, Any] | None = None
    checks: list[Check] = field(default_factory=list)
    error: str | None = None
    config: HealthConfig | None = None

    @property
    def exit_code(self) -> int:
        return self.status

    def worst_target(self) -> TargetResult | None:
        graded = [t for t in self.targets if t.starved_ratio is not None]
        return max(graded, key=lambda t: t.starved_ratio) if graded else None

    def top_category(self) -> str | None:
        """The worst target's top finding, else the category of the worst failing node
        check."""
        worst = self.worst_target()
        if worst is not None and worst.top is not None:
            return str(worst.top["category"])
        failing = [c for c in self.checks if c.status and c.pid is None and c.name in CHECK_CATEGORY]
        if not failing:
            return None
        top = max(failing, key=lambda c: (c.status, (c.value or 0.0) / c.threshold.warning if c.threshold.warning > 0 else math.inf))
        return CHECK_CATEGORY[top.name]


def overall_status(checks: list[Check], targets: list[TargetResult], error: str | None) -> int:
    """3 when any part could not be checked, else the worst graded status."""
    if error is not None or any(t.error for t in targets):
        return UNKNOWN
    return max([OK] + [c.status for c in checks] + [t.status for t in targets])


def tree_tids(threads: pd.DataFrame, *, pids: set[int], tids: set[int]) -> set[int]:
    """`tids` plus every thread the trace saw start in one of the processes `pids`, or in
    a process that one of those threads created (trace "thread" rows)."""
    pids, tids = set(pids), set(tids)
    for row in threads.sort_values("ts_ns", kind="stable").itertuples(index=False):
        if row.name == "process" and not pd.isna(row.peer_tid) and int(row.peer_tid) in tids:
            pids.add(int(row.pid))
        if not pd.isna(row.pid) and int(row.pid) in pids:
            tids.add(int(row.tid))
    return tids


def assess(*, trace_path: Path, targets: list[Target], trees: Mapping[int, tuple[set[int], set[int]]],
           config: HealthConfig, started: float, host: str) -> HealthResult:
    """Grade a recorded trace: every target, then the node.  `trees` maps a target to
    the (process ids, thread ids) of its tree when it was chosen."""
    from trainbpf.tracefile import read_trace

    trace = read_trace(trace_path)
    node = node_metrics(trace)
    threads = trace.frame("thread")
    results = []
    for t in targets:
        pids, tids = trees.get(t.pid, ({t.pid}, {t.pid}))
        results.append(analyze_target(trace_path=trace_path, target=t, tids=tree_tids(threads, pids=pids, tids=tids),
                                      thresholds=config.thresholds))
    checks = [make_check("starved_ratio", r.starved_ratio, config.thresholds, r.target.pid) for r in results if r.error is None]
    checks += [make_check(name, value, config.thresholds) for name, value in node_check_values(node).items()]
    error = "; ".join(r.error for r in results if r.error) or None
    return HealthResult(overall_status(checks, results, None), host, started, time.time(),
                        "targets" if targets else "node", results, node, checks, error, config)


# -- the run -----------------------------------------------------------------------------

@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """A non-blocking flock on `path`: a second run raises HealthBusy instead of waiting
    (the kernel drops the lock when the process ends, however it ends)."""
    try:
        # Not through a symlink, and (checked below) only our own plain file: a lock file
        # in a folder others can write must not truncate whatever they point it at.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        # ELOOP, or EACCES for another user's symlink in a sticky folder
        why = "is a symbolic link; remove it" if os.path.islink(path) else exc.strerror or exc
        raise OutputError(f"lock file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise OutputError(f"lock file {path} is not a plain file of uid {os.geteuid()}'s own; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise HealthBusy(f"another health check (pid {holder}) holds {path}; this run skipped") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def time_limit(seconds: float, *, on_backstop: Callable[[], None] | None = None,
               grace_s: float = BACKSTOP_GRACE_S) -> Iterator[threading.Event]:
    """Bound the block to `seconds`.  At the limit SIGALRM ends it: during a recording it
    raises SIGTERM, which the recorder answers by stopping and detaching its probes; at
    any other point it raises CheckTimeout.  SIGTERM and SIGINT raise CheckInterrupted.
    If the block is still running `grace_s` later, `on_backstop` runs and the process
    exits 3 (the kernel detaches whatever it still held).  Yields the event that says the
    limit was reached.  Signals work only in the main thread; elsewhere only the
    backstop applies."""
    expired = threading.Event()
    done = threading.Event()

    def backstop() -> None:
        if done.wait(seconds + grace_s):
            return
        sys.stderr.write(f"trainbpf: error: health check still running {grace_s:g} s after its "
                         f"time limit of {seconds:g} s; ending it\n")
        if on_backstop is not None:
            with contextlib.suppress(Exception):
                on_backstop()
        os._exit(UNKNOWN)

    def interrupted(signum, _frame) -> None:
        raise CheckInterrupted(f"interrupted by {signal.Signals(signum).name}")

    def alarm(_signum, _frame) -> None:
        expired.set()
        if signal.getsignal(signal.SIGTERM) is not interrupted:  # the recorder's handler
            signal.raise_signal(signal.SIGTERM)
        else:
            raise CheckTimeout(f"time limit of {seconds:g} s reached")

    watchdog = threading.Thread(target=backstop, name="health-backstop", daemon=True)
    watchdog.start()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    try:
        if in_main:
            for sig, handler in ((signal.SIGALRM, alarm), (signal.SIGTERM, interrupted), (signal.SIGINT, interrupted)):
                previous[sig] = signal.signal(sig, handler)
            signal.setitimer(signal.ITIMER_REAL, seconds)
        yield expired
    finally:
        if in_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        done.set()


def check_outputs(config: HealthConfig) -> None:
    """Fail before recording when an output cannot be written."""
    if config.textfile_dir is not None:
        if not config.textfile_dir.is_dir():
            raise OutputError(f"textfile folder {config.textfile_dir} does not exist")
        if not os.access(config.textfile_dir, os.W_OK):
            raise OutputError(f"textfile folder {config.textfile_dir} is not writable")
    textfile = config.textfile_dir / TEXTFILE_NAME if config.textfile_dir is not None else None
    for path in (textfile, config.json_file, config.trace_file):
        if path is not None:
            check_output(path, force=True)  # replaced each run, but never a symlink or device


TEMP_PREFIX = "trainbpf-health-"


def remove_stale_temp_dirs(folder: str | None = None) -> list[str]:
    """Remove the temporary folders (and the spools in them) of health runs that were
    killed: ours (same uid), named for a process that no longer runs.  Returns their names."""
    folder = folder or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if not entry.name.startswith(TEMP_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            pid = entry.name[len(TEMP_PREFIX):].split("-")[0]
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid() or (pid.isdigit() and _alive(int(pid))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)  # does not follow symlinks inside
            removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _record(*, root: int | None, output: Path, config: HealthConfig, expired: threading.Event) -> None:
    from trainbpf.tracer.collector import Settings
    from trainbpf.tracer.record import record

    result = record(pid=root, output=output, duration=config.duration_s, settings=Settings(trace_all=root is None),
                    gpu=config.gpu, handle_signals=threading.current_thread() is threading.main_thread(),
                    force=True)  # the trace of the previous run
    if expired.is_set():
        raise CheckTimeout(f"time limit of {config.limit_s:g} s reached while recording")
    if result.stop_reason in ("interrupted", "terminated"):
        raise CheckInterrupted(f"recording {result.stop_reason}")


def _check(config: HealthConfig, *, started: float, host: str, expired: threading.Event,
           progress: dict[str, Any]) -> HealthResult:
    processes = scan_processes(device_glob=config.device_glob)
    if config.pids:
        targets = given_targets(processes, config.pids)
    else:
        mine = set(ancestry(processes, os.getpid())) | {os.getpid()}
        targets = choose_targets(processes, command_patterns=config.command_patterns,
                                 exclude_patterns=config.exclude_patterns, skip=mine)
    progress["targets"] = targets
    root = recording_root(processes, [t.pid for t in targets])
    trees = {}
    for t in targets:
        pids = tree_pids(processes, t.pid)
        trees[t.pid] = (pids, _tids_of(pids))
    with contextlib.ExitStack() as stack:
        if config.trace_file is not None:
            trace_path = config.trace_file
            from trainbpf.tracefile import discard_stale_spool, spool_path_for

            discard_stale_spool(spool_path_for(trace_path))  # a killed run's scratch
        else:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
            trace_path = Path(folder) / "trace.parquet"
        _record(root=root, output=trace_path, config=config, expired=expired)
        return assess(trace_path=trace_path, targets=targets, trees=trees, config=config,
                      started=started, host=host)


def failed_result(*, config: HealthConfig, started: float, host: str, error: str,
                  targets: list[Target] | None = None) -> HealthResult:
    targets = targets or []
    return HealthResult(UNKNOWN, host, started, time.time(), "targets" if targets else "node",
                        [TargetResult(t, error="not checked") for t in targets], None, [], error, config)


def run_health(*, config: HealthConfig) -> HealthResult:
    """One health check with its outputs written.  Raises HealthBusy when another run
    holds the lock and UsageError/OutputError before anything is measured; every later
    failure becomes a result with status 3 (written, so the fleet sees it)."""
    if os.geteuid() != 0:
        raise NotRootError("the health check records with BPF: run it as root (sudo trainbpf health)")
    check_outputs(config)
    host = socket.gethostname()
    with exclusive_lock(config.lock_file):
        remove_stale_temp_dirs()
        started = time.time()
        progress: dict[str, Any] = {}

        def give_up() -> None:
            write_outputs(failed_result(config=config, started=started, host=host, targets=progress.get("targets"),
                                        error=f"time limit of {config.limit_s:g} s reached; the run was ended"), config)

        try:
            with time_limit(config.limit_s, on_backstop=give_up) as expired:
                result = _check(config, started=started, host=host, expired=expired, progress=progress)
        except TrainbpfError as exc:
            result = failed_result(config=config, started=started, host=host, error=str(exc),
                                   targets=progress.get("targets"))
        except Exception as exc:  # a crash must read "could not check" in Prometheus too
            traceback.print_exc(file=sys.stderr)  # for the bug report
            result = failed_result(config=config, started=started, host=host, targets=progress.get("targets"),
                                   error=f"internal error: {type(exc).__name__}: {exc}")
        write_outputs(result, config)
        return result


# -- outputs -----------------------------------------------------------------------------

# Every metric family written: name -> HELP text.  All are gauges in base units.
METRICS: dict[str, str] = {
    "trainbpf_health_status": "Outcome of the last health check: 0 ok, 1 warning, 2 critical, 3 could not check.",
    "trainbpf_health_last_run_timestamp_seconds": "Unix time the last health check finished.",
    "trainbpf_health_run_seconds": "Wall-clock seconds the last health check took (recording, analysis, output).",
    "trainbpf_health_recorded_seconds": "Seconds of trace the last health check recorded.",
    "trainbpf_health_targets": "Training processes the last health check analysed (0: node-level check only).",
    "trainbpf_health_system_wide": "1 when the trace covered every thread on the node, 0 when only the targets' process tree.",
    "trainbpf_health_lost_events": "Events the probes dropped during the check (ring buffer full).",
    "trainbpf_health_check_value": "Value a node-level threshold was compared with, per check.",
    "trainbpf_health_check_status": "Outcome of one node-level check: 0 ok, 1 warning, 2 critical.",
    "trainbpf_target_info": "A training process the check analysed (value 1); reason: pid (given), device (holds a GPU device file) or pattern (command matched).",
    "trainbpf_target_status": "Outcome for one training process: 0 ok, 1 warning, 2 critical, 3 could not check.",
    "trainbpf_target_starved_seconds": "Seconds the trainer thread was stalled while the GPU idled (without GPU samples: while it was not running).",
    "trainbpf_target_starved_ratio": "Starved seconds per recorded second.",
    "trainbpf_finding_share_ratio": "Share of the target's starved time that one cause explains.",
    "trainbpf_finding_seconds": "Starved seconds that one cause explains.",
    "trainbpf_thread_state_seconds": "Seconds the target's threads of one role spent in one state, summed over those threads.",
    "trainbpf_node_runqueue_seconds": "Seconds traced threads spent runnable, waiting for a CPU, summed over threads.",
    "trainbpf_node_runqueue_latency_p99_seconds": "99th percentile of the wake-up (or preemption) to switch-in latency of traced threads.",
    "trainbpf_node_runqueue_latency_max_seconds": "Longest wake-up (or preemption) to switch-in latency of a traced thread.",
    "trainbpf_node_reclaim_seconds": "Seconds traced threads spent in direct or memcg reclaim.",
    "trainbpf_node_compaction_seconds": "Seconds traced threads spent compacting memory.",
    "trainbpf_node_dirty_throttle_seconds": "Seconds traced writers were paused by dirty-page throttling (balance_dirty_pages).",
    "trainbpf_node_pressure_ratio": "Share of the check's time some (or all) tasks stalled on a resource (PSI).",
    "trainbpf_node_numa_remote_ratio": "Share of page allocations made for a task running on another NUMA node (vmstat numa_other).",
    "trainbpf_node_numa_pages_migrated": "Pages NUMA balancing migrated during the check.",
    "trainbpf_node_numa_task_moves": "Scheduler NUMA moves and swaps of traced tasks during the check.",
    "trainbpf_gpu_idle_ratio": "Share of the recorded time a GPU was idle (1 - mean utilisation).",
}

Sample = tuple[str, dict[str, str], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if isinstance(value, (int, np.integer)) or float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def metric_samples(result: HealthResult) -> list[Sample]:
    """Every sample of the textfile, as (metric, labels, value); None values left out."""
    out: list[Sample] = []

    def add(name: str, value: float | None, **labels: Any) -> None:
        if value is not None and math.isfinite(float(value)):
            out.append((name, {k: str(v) for k, v in labels.items()}, float(value)))

    node = result.node or {}
    add("trainbpf_health_status", result.status)
    add("trainbpf_health_last_run_timestamp_seconds", round(result.finished, 3))
    add("trainbpf_health_run_seconds", round(result.finished - result.started, 3))
    add("trainbpf_health_recorded_seconds", node.get("recorded_seconds"))
    add("trainbpf_health_targets", len(result.targets))
    if result.node is not None:
        add("trainbpf_health_system_wide", int(node["system_wide"]))
        add("trainbpf_health_lost_events", node["lost_events"])
    for c in result.checks:
        if c.pid is None:
            add("trainbpf_health_check_value", c.value, check=c.name)
            add("trainbpf_health_check_status", c.status, check=c.name)
    for t in result.targets:
        pid = t.target.pid
        add("trainbpf_target_info", 1, pid=pid, comm=t.target.comm, reason=t.target.reason)
        add("trainbpf_target_status", t.status, pid=pid)
        add("trainbpf_target_starved_seconds", t.starved_s, pid=pid)
        add("trainbpf_target_starved_ratio", t.starved_ratio, pid=pid)
        for f in t.findings:
            add("trainbpf_finding_share_ratio", f["share"], pid=pid, category=f["category"])
            add("trainbpf_finding_seconds", f["seconds"], pid=pid, category=f["category"])
        for (role, state), seconds in sorted(t.role_seconds.items()):
            add("trainbpf_thread_state_seconds", seconds, pid=pid, role=role, state=state)
    if result.node is not None:
        for key in ("runqueue_seconds", "runqueue_latency_p99_seconds", "runqueue_latency_max_seconds",
                    "reclaim_seconds", "compaction_seconds", "dirty_throttle_seconds", "numa_remote_ratio",
                    "numa_pages_migrated", "numa_task_moves"):
            add(f"trainbpf_node_{key}", node[key])
        for name, ratio in sorted(node["pressure"].items()):
            resource, _, kind = name.partition(".")
            add("trainbpf_node_pressure_ratio", ratio, resource=resource, kind=kind)
        for gpu, ratio in sorted(node["gpu_idle_ratio"].items()):
            add("trainbpf_gpu_idle_ratio", ratio, gpu=gpu)
    return out


def render_textfile(result: HealthResult) -> str:
    """The Prometheus text exposition: HELP and TYPE once per family, then its samples."""
    by_family: dict[str, list[Sample]] = {}
    for sample in metric_samples(result):
        by_family.setdefault(sample[0], []).append(sample)
    lines = []
    for name, samples in by_family.items():
        lines += [f"# HELP {name} {METRICS[name]}", f"# TYPE {name} gauge"]
        for _, labels, value in samples:
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {_format_value(value)}" if text else f"{name} {_format_value(value)}")
    return "\n".join(lines) + "\n"


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _json_number(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def health_document(result: HealthResult) -> dict[str, Any]:
    """The JSON document of one run (schema trainbpf.health/1)."""
    config = result.config or HealthConfig()
    worst = result.worst_target()
    return {
        "schema": HEALTH_SCHEMA,
        "host": result.host,
        "status": STATUS_NAMES[result.status],
        "exit_code": result.status,
        "error": result.error,
        "started": _iso(result.started),
        "finished": _iso(result.finished),
        "finished_timestamp": round(result.finished, 3),
        "run_s": round(result.finished - result.started, 3),
        "mode": result.mode,
        "starved_ratio": None if worst is None else worst.starved_ratio,
        "top_category": result.top_category(),
        "targets": [{
            "pid": t.target.pid, "comm": t.target.comm, "cmdline": t.target.cmdline[:200], "reason": t.target.reason,
            "status": STATUS_NAMES[t.status], "error": t.error, "starved_s": t.starved_s, "starved_ratio": t.starved_ratio,
            "gpu_idle_fraction": t.gpu_idle_fraction, "findings": t.findings,
            "thread_seconds": [{"role": r, "state": s, "seconds": v} for (r, s), v in sorted(t.role_seconds.items())],
        } for t in result.targets],
        "node": result.node,
        "checks": [{"check": c.name, "pid": c.pid, "value": c.value, "warning": _json_number(c.threshold.warning),
                    "critical": _json_number(c.threshold.critical), "status": STATUS_NAMES[c.status]} for c in result.checks],
        "config": {"duration_s": config.duration_s, "time_limit_s": config.limit_s, "gpu": config.gpu,
                   "device_glob": config.device_glob, "command_patterns": list(config.command_patterns)},
    }


def write_atomic(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Write `text` out of sight (an unnamed file, or a random name node_exporter
    ignores), then rename it over `path`: readers see the old file or the new one,
    never half.  A symlink or other non-regular file at `path` is refused, not replaced
    or written through (trainbpf.safefile)."""
    write_new(path, lambda fh: fh.write(text.encode()), mode=mode, force=True)


def write_outputs(result: HealthResult, config: HealthConfig) -> None:
    if config.textfile_dir is not None:
        write_atomic(config.textfile_dir / TEXTFILE_NAME, render_textfile(result))
    if config.json_file is not None:
        write_atomic(config.json_file, json.dumps(health_document(result), indent=2) + "\n")


def render_summary(result: HealthResult) -> str:
    """A few lines for a person (or a cron mail)."""
    node = result.node or {}
    head = (f"trainbpf health: {STATUS_NAMES[result.status]} ({result.status}) on {result.host}: "
            f"{len(result.targets) or 'no'} target{'s' if len(result.targets) != 1 else ''}")
    if node:
        head += f", {node['recorded_seconds']:.1f} s recorded ({'whole machine' if node['system_wide'] else 'targets tree'})"
    lines = [head]
    for t in result.targets:
        line = f"  pid {t.target.pid} {t.target.comm} [{t.target.reason}]: {STATUS_NAMES[t.status]}"
        if t.starved_ratio is not None:
            line += f", starved {t.starved_ratio:.0%} of the time"
        if t.top is not None:
            line += f"; top cause {t.top['category']} ({t.top['share']:.0%} of starved time)"
        lines.append(line)
    for c in result.checks:
        if c.status and c.pid is None:
            level = c.threshold.critical if c.status == CRITICAL else c.threshold.warning
            lines.append(f"  {c.name} = {c.value:.4g} (>= {level:g}): {STATUS_NAMES[c.status]}")
    return "\n".join(lines)
