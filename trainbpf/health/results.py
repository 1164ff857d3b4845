"""What a health check found, graded: one Check per value compared with its thresholds,
one TargetResult per training process, and the HealthResult of the run (with the ranks
and straggler of the job the trace held, if it held one)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from trainbpf.analyzers.causes.categories import CHECK_CATEGORY
from trainbpf.health.config import CRITICAL, OK, UNKNOWN, WARNING, HealthConfig, Threshold
from trainbpf.health.targets import Target


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


@dataclass(frozen=True)
class StepMetrics:
    """The trainer's training steps, from its CUDA calls (analyzers/cuda.step_summary).
    `traced` False: no CUDA call of the trainer was seen, and every other field is None
    (never a zero that reads like a measurement).  Traced without a complete step: steps
    0, the rest None."""

    traced: bool
    steps: int | None = None
    steps_per_s: float | None = None
    step_p50_s: float | None = None
    step_p99_s: float | None = None
    host_bound_share: float | None = None  # launch-gap time / step time
    faults_per_step: float | None = None  # page faults of the target's threads / steps

    FIELDS = ("steps", "steps_per_s", "step_p50_s", "step_p99_s", "host_bound_share", "faults_per_step")

    def as_dict(self) -> dict[str, Any]:
        return {"traced": self.traced, **{k: getattr(self, k) for k in self.FIELDS}}


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def step_metrics(uses_cuda: bool, summary: Mapping[str, Any] | None, *, faults: int | None = None) -> StepMetrics:
    """StepMetrics of an Analysis's `uses_cuda` and `cuda_steps`; `faults`: the page
    faults the target's threads took in the analysed window (None: not known)."""
    if not uses_cuda:
        return StepMetrics(False)
    if not summary or not summary.get("steps"):
        return StepMetrics(True, steps=0)
    steps = int(summary["steps"])
    return StepMetrics(True, steps, _finite(summary.get("steps_per_s")), _finite(summary.get("step_p50_s")),
                       _finite(summary.get("step_p99_s")), _finite(summary.get("host_bound_share")),
                       None if faults is None else faults / steps)


@dataclass
class TargetResult:
    target: Target
    status: int = UNKNOWN
    starved_s: float | None = None
    starved_ratio: float | None = None
    host_bound_s: float | None = None  # the part of starved_s the trainer's own CPU work explains
    gpu_idle_fraction: float | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    role_seconds: dict[tuple[str, str], float] = field(default_factory=dict)  # (role, state) -> s
    error: str | None = None
    steps: StepMetrics | None = None  # None: not analysed
    network_wait: dict[str, float] = field(default_factory=dict)  # peer (top few, then "other") -> starved s
    remote_copy_share: float | None = None  # host->GPU bytes from pages off the GPU's node / all (report's numa)

    @property
    def top(self) -> dict[str, Any] | None:
        return self.findings[0] if self.findings else None

    @property
    def host_bound_share(self) -> float | None:
        """Host-bound seconds per starved second (None before grading or when not starved)."""
        if self.host_bound_s is None or not self.starved_s:
            return None
        return self.host_bound_s / self.starved_s


def grade_report(target: Target, report: Mapping[str, Any], *, tids: set[int],
                 thresholds: Mapping[str, Threshold], steps: StepMetrics | None = None) -> TargetResult:
    """Grade one target from its `trainbpf analyze` report (trainbpf.reports.document.build_report,
    the JSON contract); `tids` are the threads of its process tree, `steps` its trainer's
    steps (step_metrics).  Only the starved ratio grades: step time and host-bound share
    are reported, never graded (docs/health.md).  A job's report (a launcher's target)
    sums starved time over its ranks: its ratio is per rank and recorded second."""
    result = TargetResult(target, steps=steps)
    duration = float(report["trace"]["duration_s"] or 0.0) * max(1, len(report.get("ranks") or ()))
    result.starved_s = float(report["starved_s"])
    result.starved_ratio = result.starved_s / duration if duration > 0 else None
    result.host_bound_s = float(report["host_bound_s"])
    result.gpu_idle_fraction = report["gpu"]["idle_fraction"]
    result.remote_copy_share = (report.get("numa") or {}).get("remote_share")
    result.findings = [{k: f[k] for k in ("category", "share", "seconds", "severity", "summary")} for f in report["findings"]]
    for th in report["threads"]:
        if th["tid"] in tids:
            for state, seconds in th["seconds"].items():
                key = (th["role"], state)
                result.role_seconds[key] = round(result.role_seconds.get(key, 0.0) + float(seconds), 6)
    result.network_wait = network_wait(report["findings"])
    result.status = make_check("starved_ratio", result.starved_ratio, thresholds, target.pid).status
    return result


# Peers named as a label of trainbpf_network_wait_seconds at most (the rest are "other").
NETWORK_PEER_LABELS = 3


def network_wait(findings: list[Mapping[str, Any]]) -> dict[str, float]:
    """The starved seconds network_io findings explain, per peer waited on: the top
    NETWORK_PEER_LABELS peers by name, the rest (and waits matched to no socket) as "other"."""
    per: dict[str, float] = {}
    total = 0.0
    for f in findings:
        if f["category"] != "network_io":
            continue
        total += float(f["seconds"])
        for c in f.get("culprits") or ():
            if c.get("kind") == "peer":
                per[str(c["name"])] = per.get(str(c["name"]), 0.0) + float(c["seconds"])
    top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:NETWORK_PEER_LABELS])
    rest = max(0.0, total - sum(top.values()))
    return {**{k: round(v, 6) for k, v in top.items()}, **({"other": round(rest, 6)} if rest > 1e-6 else {})}


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
    # The job the trace held (several ranks): its report's `ranks` and `straggler`; None: one process.
    job: dict[str, Any] | None = None

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


def failed_result(*, config: HealthConfig, started: float, host: str, error: str,
                  targets: list[Target] | None = None) -> HealthResult:
    targets = targets or []
    return HealthResult(UNKNOWN, host, started, time.time(), "targets" if targets else "node",
                        [TargetResult(t, error="not checked") for t in targets], None, [], error, config)
