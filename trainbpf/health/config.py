"""The health check's settings: every default in one place, the TOML config file, the
command line's overrides on top, and the validation both go through."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from trainbpf.trace.documents import TooDeep, load_toml
from trainbpf.trace.errors import UsageError
from trainbpf.trace.safefile import read_small
from trainbpf.tracer.settings import GPU_MODES

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
STATUS_NAMES = {OK: "ok", WARNING: "warning", CRITICAL: "critical", UNKNOWN: "unknown"}

DEFAULT_CONFIG_PATH = Path("/etc/trainbpf/health.toml")
DEFAULT_LOCK_FILE = Path("/run/trainbpf-health.lock")  # the node's: taken as root, even under sudo
TEXTFILE_NAME = "trainbpf_health.prom"


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


DEFAULT_COMMAND_PATTERNS = (r"\btorchrun\b", r"\btorch\.distributed\.(run|launch)\b", r"\bdeepspeed\b", r"\baccelerate launch\b")
# Daemons that hold GPU device files open without training anything.
DEFAULT_EXCLUDE_PATTERNS = (r"nvidia-persistenced", r"nv-hostengine", r"dcgm", r"nvidia-smi", r"\bXorg\b", r"gdm|gnome-shell")

@dataclass(frozen=True)
class HealthConfig:
    duration_s: float = 10.0
    time_limit_s: float | None = None  # None: duration_s + 60
    lock_file: Path = DEFAULT_LOCK_FILE
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
    if not config.device_glob.startswith("/") or "\0" in config.device_glob:
        raise UsageError(f"{source}: device_glob {config.device_glob!r}: expected an absolute path pattern "
                         "such as /dev/nvidia*")
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
    try:  # read as the user who named it: a small regular file, never waited on
        raw = load_toml(read_small(path, f"config {path}").decode())
    except TooDeep as exc:
        raise UsageError(f"config {path}: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # tomllib.TOMLDecodeError
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
