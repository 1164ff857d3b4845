"""What a health check writes: the Prometheus textfile (for node_exporter's textfile
collector), the JSON document (schema trainbpf.health/1, merged by `trainbpf fleet`) and
the few lines a person reads."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from trainbpf.health.config import CRITICAL, STATUS_NAMES, TEXTFILE_NAME, HealthConfig
from trainbpf.health.results import HealthResult, StepMetrics
from trainbpf.reports.job import straggler_sentence
from trainbpf.trace.safefile import write_new

HEALTH_SCHEMA = "trainbpf.health/1"

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
    "trainbpf_target_host_bound_seconds": "Starved seconds the trainer's own CPU work explains (it was busy on the CPU, outside GPU synchronisations, while the GPU idled).",
    "trainbpf_target_host_bound_share_ratio": "Share of the target's starved time that is host-bound (the trainer's own CPU work).",
    "trainbpf_finding_share_ratio": "Share of the target's starved time that one cause explains.",
    "trainbpf_finding_seconds": "Starved seconds that one cause explains.",
    "trainbpf_network_wait_seconds": "Starved seconds that waits on the network explain, per peer waited on (the top three by address, the rest as peer=\"other\").",
    "trainbpf_target_cuda_traced": "1 when the trainer's CUDA calls were traced (the step metrics follow), 0 when none was seen (no step metrics).",
    "trainbpf_target_steps": "Training steps the trainer completed during the check, from its CUDA waits and launches.",
    "trainbpf_target_steps_per_second": "Training steps per second over the stretch the complete steps cover.",
    "trainbpf_target_step_p50_seconds": "Median training step time.",
    "trainbpf_target_step_p99_seconds": "99th percentile of the training step time.",
    "trainbpf_target_host_bound_ratio": "Share of the step time from the end of a GPU wait to the next kernel launch (the host preparing work; reported, not graded).",
    "trainbpf_target_faults_per_step": "Page faults the target's threads took per training step (about 256 per MiB of fresh memory with 4 KiB pages, 0.5 with 2 MiB huge pages).",
    "trainbpf_target_numa_remote_copy_ratio": "Share of the bytes the target copied from host memory to the GPU whose source pages were on a NUMA node other than the GPU's (a query-only move_pages of each copy's source page).",
    "trainbpf_thread_state_seconds": "Seconds the target's threads of one role spent in one state, summed over those threads.",
    "trainbpf_rank_starved_seconds": "Seconds one rank's trainer was starved (stalled while its GPU idled; without GPU samples, while it was not running), its waits for late ranks included.",
    "trainbpf_rank_collective_wait_seconds": "Seconds one rank's trainer waited inside collectives for the other ranks.",
    "trainbpf_rank_last_arrival_ratio": "Share of the collectives one rank arrived at last (the others waited for it).",
    "trainbpf_straggler_rank": "Rank the other ranks of the job waited for in their collectives (the straggler); -1 when no rank held the others back.",
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

# StepMetrics field -> metric; written only for a target whose CUDA calls were traced.
STEP_METRICS = {"steps": "trainbpf_target_steps", "steps_per_s": "trainbpf_target_steps_per_second",
                "step_p50_s": "trainbpf_target_step_p50_seconds", "step_p99_s": "trainbpf_target_step_p99_seconds",
                "host_bound_share": "trainbpf_target_host_bound_ratio",
                "faults_per_step": "trainbpf_target_faults_per_step"}

Sample = tuple[str, dict[str, str], float]


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
        add("trainbpf_target_host_bound_seconds", t.host_bound_s, pid=pid)
        add("trainbpf_target_host_bound_share_ratio", t.host_bound_share, pid=pid)
        for f in t.findings:
            add("trainbpf_finding_share_ratio", f["share"], pid=pid, category=f["category"])
            add("trainbpf_finding_seconds", f["seconds"], pid=pid, category=f["category"])
        for peer, seconds in t.network_wait.items():
            add("trainbpf_network_wait_seconds", seconds, pid=pid, peer=peer)
        if t.steps is not None:
            add("trainbpf_target_cuda_traced", int(t.steps.traced), pid=pid)
            for key, metric in STEP_METRICS.items():
                add(metric, getattr(t.steps, key), pid=pid)
        add("trainbpf_target_numa_remote_copy_ratio", t.remote_copy_share, pid=pid)
        for (role, state), seconds in sorted(t.role_seconds.items()):
            add("trainbpf_thread_state_seconds", seconds, pid=pid, role=role, state=state)
    if result.job is not None:  # a job of several ranks: each rank by its process and number
        for r in result.job["ranks"]:
            add("trainbpf_rank_starved_seconds", r["starved_s"], pid=r["pid"], rank=r["rank"])
            add("trainbpf_rank_collective_wait_seconds", r["collective_wait_s"], pid=r["pid"], rank=r["rank"])
            add("trainbpf_rank_last_arrival_ratio", r["last_arrival_share"], pid=r["pid"], rank=r["rank"])
        straggler = result.job["straggler"]
        add("trainbpf_straggler_rank", -1 if straggler is None else straggler["rank"])
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


class _ResultCollector:
    """A prometheus_client collector of one result: a gauge family per metric name."""

    def __init__(self, result: HealthResult):
        self.result = result

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for name, labels, value in metric_samples(self.result):
            if name not in families:
                families[name] = Metric(name, METRICS[name], "gauge")
            families[name].add_sample(name, labels, value)
        return list(families.values())


def render_textfile(result: HealthResult) -> str:
    """The Prometheus text exposition: HELP and TYPE once per family, then its samples."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ResultCollector(result))
    return generate_latest(registry).decode()


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _json_number(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def steps_document(steps: StepMetrics | None) -> dict[str, Any]:
    """A target's steps in the JSON: always the same keys; `traced` null and every value
    null when the target was not analysed, false (values null) when no CUDA call was seen."""
    if steps is None:
        return {"traced": None, **dict.fromkeys(StepMetrics.FIELDS)}
    return steps.as_dict()


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
        "steps": steps_document(None if worst is None else worst.steps),
        "targets": [{
            "pid": t.target.pid, "comm": t.target.comm, "cmdline": t.target.cmdline[:200], "reason": t.target.reason,
            "status": STATUS_NAMES[t.status], "error": t.error, "starved_s": t.starved_s, "starved_ratio": t.starved_ratio,
            "host_bound_s": t.host_bound_s,
            "gpu_idle_fraction": t.gpu_idle_fraction, "findings": t.findings, "steps": steps_document(t.steps),
            "thread_seconds": [{"role": r, "state": s, "seconds": v} for (r, s), v in sorted(t.role_seconds.items())],
            "network_wait_seconds": dict(t.network_wait),
        } for t in result.targets],
        "job": result.job,
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
    or written through (trainbpf.trace.safefile)."""
    write_new(path, lambda fh: fh.write(text.encode()), mode=mode, force=True)


def write_outputs(result: HealthResult, config: HealthConfig) -> None:
    # Not prometheus_client's write_to_textfile: its temporary file has a predictable
    # name (PATH.PID.THREAD) that it opens through a planted symlink, and the umask's
    # mode; write_atomic refuses symlinks and makes the file 0644 for node_exporter.
    if config.textfile_dir is not None:
        write_atomic(config.textfile_dir / TEXTFILE_NAME, render_textfile(result))
    if config.json_file is not None:
        write_atomic(config.json_file, json.dumps(health_document(result), indent=2) + "\n")


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3g} ms"


def steps_summary(steps: StepMetrics) -> str:
    """The steps of one target in a few words."""
    if not steps.traced:
        return "CUDA not traced"
    if not steps.steps:
        return "CUDA traced, no complete step"
    text = f"step {_ms(steps.step_p50_s)} p50, {_ms(steps.step_p99_s)} p99"
    if steps.steps_per_s is not None:
        text += f", {steps.steps_per_s:.3g} steps/s"
    if steps.host_bound_share is not None:
        text += f", {steps.host_bound_share:.0%} host-bound"
    return text


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
        if t.steps is not None:
            line += "; " + steps_summary(t.steps)
        lines.append(line)
    if result.job is not None:
        lines.append(f"  job of {len(result.job['ranks'])} ranks; straggler: {straggler_sentence(result.job['straggler'])}")
    for c in result.checks:
        if c.status and c.pid is None:
            level = c.threshold.critical if c.status == CRITICAL else c.threshold.warning
            lines.append(f"  {c.name} = {c.value:.4g} (>= {level:g}): {STATUS_NAMES[c.status]}")
    return "\n".join(lines)
