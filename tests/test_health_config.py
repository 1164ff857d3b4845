"""`trainbpf health` settings: defaults, the TOML file, the command line on top, bad
input as one line (exit 3), and the docs and systemd units that spell them out."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_env import which_or_fail
from trainbpf.health.config import (
    CONFIG_KEYS,
    DEFAULT_THRESHOLDS,
    WARNING,
    HealthConfig,
    Threshold,
    config_from_mapping,
    health_config,
    load_config,
)
from trainbpf.health.outputs import METRICS
from trainbpf.health.results import grade
from trainbpf.trace.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
TRAINBPF = [sys.executable, "-m", "trainbpf.cli"]


def test_example_config_spells_out_the_defaults():
    config = load_config(ROOT / "scripts/trainbpf-health.toml")
    defaults = HealthConfig()
    differs = {f.name for f in dataclasses.fields(HealthConfig) if getattr(config, f.name) != getattr(defaults, f.name)}
    assert differs == {"textfile_dir", "json_file"}
    assert config.limit_s == defaults.duration_s + 60


def test_config_overrides_thresholds_partially_and_inf_turns_a_level_off():
    config = config_from_mapping({"duration_s": 3, "thresholds": {"starved_ratio": {"critical": math.inf},
                                                                  "reclaim_ratio": {"warning": 0.2, "critical": 0.3}}}, source="t")
    assert config.duration_s == 3.0 and config.limit_s == 63.0
    assert config.thresholds["starved_ratio"] == Threshold(0.2, math.inf)
    assert config.thresholds["reclaim_ratio"] == Threshold(0.2, 0.3)
    assert config.thresholds["io_pressure_ratio"] == DEFAULT_THRESHOLDS["io_pressure_ratio"]
    assert grade(10.0, config.thresholds["starved_ratio"]) == WARNING


@pytest.mark.parametrize("raw, message", [
    ({"duraton_s": 3}, "unknown key"),
    ({"duration_s": "ten"}, "expected a number"),
    ({"duration_s": 0}, "duration_s must be positive"),
    ({"time_limit_s": -1}, "time_limit_s must be positive"),
    ({"gpu": "cuda"}, "choose auto"),
    ({"command_patterns": "torchrun"}, "list of regular expressions"),
    ({"command_patterns": ["(torchrun"]}, "bad regular expression"),
    ({"thresholds": {"starved": {"warning": 1}}}, "unknown threshold"),
    ({"thresholds": {"starved_ratio": {"warning": 0.6, "critical": 0.5}}}, "above critical"),
    ({"thresholds": {"starved_ratio": 0.5}}, "warning = N"),
    ({"lock_file": ""}, "expected a path"),
    ({"duration_s": float("inf")}, "at most 86400"),  # issue 15 M3: was two OverflowError tracebacks
    ({"time_limit_s": 1e12}, "at most"),
    ({"thresholds": {"starved_ratio": {"warning": -0.5}}}, "not negative"),  # M5: was accepted
    ({"device_glob": "dev/nvidia*"}, "device_glob 'dev/nvidia\\*': expected an absolute path pattern"),  # issue 34
    ({"device_glob": "/dev/nv\0*"}, "expected an absolute path pattern"),  # issue 34: glob's ValueError
])
def test_bad_config_is_one_line_usage_error(raw, message):
    with pytest.raises(UsageError, match=message) as err:
        config_from_mapping(raw, source="config x.toml")
    assert "\n" not in str(err.value)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("duration_s = [\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(UsageError, match="No such file"):
        load_config(tmp_path / "missing.toml")


def test_a_deeply_nested_config_is_one_line(tmp_path):
    """issue 34 item 6: tomllib recurses once per level; the health check read this as a
    RecursionError ("warning", exit 1)."""
    path = tmp_path / "deep.toml"
    path.write_text("duration_s = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(UsageError) as err:
        load_config(path)
    assert str(err.value) == f"config {path}: nested deeper than 64 levels"
    proc = subprocess.run([*TRAINBPF, "health", "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stderr == f"trainbpf: error: config {path}: nested deeper than 64 levels\n"


def test_command_line_wins_over_config(tmp_path):
    path = tmp_path / "h.toml"
    path.write_text('duration_s = 30\njson_file = "/nowhere/h.json"\n')
    config = health_config(config_file=path, duration=2, pids=[5, 7], json_file=tmp_path / "x.json")
    assert (config.duration_s, config.pids, config.json_file) == (2.0, (5, 7), tmp_path / "x.json")
    with pytest.raises(UsageError, match="duration_s must be positive"):
        health_config(config_file=path, duration=-1)


# -- command line ------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--duration", "abc"], "--duration"),
    (["--duration", "-2"], "duration_s must be positive"),
    (["--duration", "1e12", "--pid", "1"], "at most 86400"),  # M3: OverflowError tracebacks, "no targets"
    (["--duration", "nan"], "duration_s must be positive"),
    (["--bogus"], "No such option"),
    (["--config", "/nonexistent/health.toml"], "No such file"),
    (["--textfile-dir", "/nonexistent/dir"], "textfile folder /nonexistent/dir does not exist"),
])
def test_bad_input_exits_3_with_a_message(args, message, tmp_path):
    proc = subprocess.run([*TRAINBPF, "health", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert message in proc.stderr


def test_wrapper_passes_arguments_and_the_exit_code(tmp_path):
    env = {**os.environ, "TRAINBPF": f"{ROOT}/.venv/bin/trainbpf", "TRAINBPF_HEALTH_ARGS": "--duration -1"}
    proc = subprocess.run([ROOT / "scripts/trainbpf-health"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3 and "duration_s must be positive" in proc.stderr
    env["TRAINBPF"] = str(tmp_path / "missing")
    proc = subprocess.run([ROOT / "scripts/trainbpf-health"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3 and "trainbpf not found" in proc.stderr


# -- docs and units ----------------------------------------------------------------------

def test_docs_list_every_metric_threshold_and_config_key():
    doc = (ROOT / "docs/health.md").read_text()
    for name, help_text in METRICS.items():
        assert re.search(rf"^\| `{name}` \|[^|]*\| {re.escape(help_text)} \|$", doc, re.M), name
    for name, th in DEFAULT_THRESHOLDS.items():
        assert re.search(rf"^\| `{name}` \| {th.warning:g} \| {th.critical:g} \|", doc, re.M), name
    for key in CONFIG_KEYS:
        assert re.search(rf"^\| `\[?{key}\]?` \|", doc, re.M), key


def test_systemd_units_verify(tmp_path):
    exe = which_or_fail("systemd-analyze", "systemd")
    units = ROOT / "scripts/systemd"
    service = (units / "trainbpf-health.service").read_text()
    assert "SuccessExitStatus=1 2" in service
    # verify checks that ExecStart exists: point it at this checkout's wrapper
    (tmp_path / "trainbpf-health.service").write_text(service.replace("/usr/local/sbin/trainbpf-health", str(ROOT / "scripts/trainbpf-health")))
    (tmp_path / "trainbpf-health.timer").write_text((units / "trainbpf-health.timer").read_text())
    proc = subprocess.run([exe, "verify", tmp_path / "trainbpf-health.service", tmp_path / "trainbpf-health.timer"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    docs = (ROOT / "docs/health.md").read_text()
    for unit in ("trainbpf-health.service", "trainbpf-health.timer"):
        body = "\n".join(line for line in (units / unit).read_text().splitlines() if not line.startswith("#"))
        assert body.strip() in docs, f"docs/health.md shows an outdated {unit}"
