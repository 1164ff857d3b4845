"""What runs `trainbpf health` on a node: the Kubernetes manifests (checked against the
Kubernetes API schemas, no cluster needed) and the Slurm prolog/epilog (run with bash in
a stand-in Slurm environment: SLURM_JOB_ID, a job cgroup made for the test, stand-ins
for the health wrapper and systemd)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kernel_env import require_module, require_root

from trainbpf.health.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes" / "trainbpf-health.yaml"
PROLOG = ROOT / "deploy" / "slurm" / "trainbpf-health-prolog.sh"
EPILOG = ROOT / "deploy" / "slurm" / "trainbpf-health-epilog.sh"
# The oldest Kubernetes release still common in fleets, and the newest schema bundled.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
CAPABILITIES = ["BPF", "PERFMON", "SYS_PTRACE", "SYSLOG", "CHECKPOINT_RESTORE"]


def documents() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_manifests_follow_the_kubernetes_schemas():
    require_module("kubernetes_validate", "the manifests' schema check")
    import kubernetes_validate

    docs = documents()
    assert set(docs) == {"Namespace", "ConfigMap", "DaemonSet"}
    for version in KUBERNETES_VERSIONS:
        for doc in docs.values():  # strict: a misspelt field is an error, not ignored
            kubernetes_validate.validate(doc, version, strict=True)
    bad = documents()["DaemonSet"]
    bad["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_daemonset_runs_health_like_the_systemd_timer(tmp_path):
    """Host pids, the least capabilities, the mounts bcc and health read, the textfile in
    the folder the shipped units use, the timer's period, and a config health accepts."""
    docs = documents()
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False
    security = container["securityContext"]
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"], "add": CAPABILITIES}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for path in ("/sys/kernel/tracing", "/sys/fs/cgroup", "/usr/src", "/lib/modules", "/var/cache/trainbpf"):
        assert mounts[path]["hostPath"]["path"] == path
    service = (ROOT / "scripts" / "systemd" / "trainbpf-health.service").read_text()
    textfile_dir = re.search(r"--textfile-dir (\S+)", service).group(1)
    assert mounts[textfile_dir]["hostPath"]["path"] == textfile_dir
    script = container["args"][0]
    assert f"--textfile-dir {textfile_dir}" in script and "/opt/trainbpf/scripts/trainbpf-health" in script
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    timer = (ROOT / "scripts" / "systemd" / "trainbpf-health.timer").read_text()
    period_min = int(re.search(r"OnUnitActiveSec=(\d+)min", timer).group(1))
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["TRAINBPF_HEALTH_PERIOD_S"]) == period_min * 60
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert Path(env["TRAINBPF_HEALTH_CONFIG"]).parent == Path(config_mount["mountPath"])
    config = tmp_path / "health.toml"
    config.write_text(docs["ConfigMap"]["data"][Path(env["TRAINBPF_HEALTH_CONFIG"]).name])
    assert load_config(config).duration_s == 10.0


# -- Slurm -------------------------------------------------------------------------------

STANDIN = """#!/bin/bash
echo "$(basename "$0") $*" >> "$STANDIN_LOG"
exit "${STANDIN_EXIT:-0}"
"""


@pytest.fixture
def slurm(tmp_path):
    """Run a script as Slurm would, with the health wrapper, systemd-run and systemctl
    stood in for by scripts that log their arguments and exit with STANDIN_EXIT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("trainbpf-health", "systemd-run", "systemctl"):
        (bin_dir / name).write_text(STANDIN)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"

    def run(script: Path, *args: str, job: str | None = "4242", exit_code: int = 0, **env: str) -> tuple[int, list[str], str]:
        log.write_text("")
        environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STANDIN_LOG": str(log), "STANDIN_EXIT": str(exit_code),
                   "TRAINBPF_HEALTH": str(bin_dir / "trainbpf-health"), "TRAINBPF_HEALTH_SHARED": str(tmp_path / "shared"),
                   **({"SLURM_JOB_ID": job} if job else {}), **env}
        done = subprocess.run(["bash", str(script), *args], env=environ, capture_output=True, text=True, timeout=30)
        return done.returncode, log.read_text().splitlines(), done.stderr

    run.shared, run.bin = tmp_path / "shared", bin_dir
    return run


@pytest.mark.parametrize("verdict", [0, 2, 3])
def test_prolog_checks_the_node_schedules_the_job_check_and_never_fails(slurm, verdict):
    code, calls, stderr = slurm(PROLOG, exit_code=verdict)
    host = socket.gethostname()
    assert code == 0, stderr
    health = slurm.bin / "trainbpf-health"
    assert calls == [f"trainbpf-health --duration 3 --json {slurm.shared}/{host}-prolog.json",
                     f"systemd-run --quiet --unit=trainbpf-health-job-4242 --on-active=120 "
                     f"--setenv=TRAINBPF_HEALTH={health} --setenv=TRAINBPF_HEALTH_SHARED={slurm.shared} "
                     f"--setenv=TRAINBPF_TEXTFILE_DIR=/var/lib/prometheus/node-exporter {PROLOG} --job-check 4242"]


def test_prolog_passes_the_sites_settings_to_the_job_check(slurm):
    code, calls, _ = slurm(PROLOG, TRAINBPF_TEXTFILE_DIR="/srv/textfile", TRAINBPF_SLURM_CGROUPS="/cg/a /cg/b",
                           TRAINBPF_JOB_CHECK_DELAY="300")
    assert code == 0
    assert "--on-active=300 " in calls[1] and "--setenv=TRAINBPF_TEXTFILE_DIR=/srv/textfile " in calls[1]
    assert "--setenv=TRAINBPF_SLURM_CGROUPS=/cg/a /cg/b " in calls[1]


def test_prolog_outside_slurm_says_so_and_does_not_drain(slurm):
    code, calls, stderr = slurm(PROLOG, job=None)
    assert (code, calls) == (0, []) and "SLURM_JOB_ID is not set" in stderr


@pytest.mark.parametrize("systemctl_exit", [0, 5])
def test_epilog_stops_the_jobs_timer_and_never_fails(slurm, systemctl_exit):
    code, calls, _ = slurm(EPILOG, exit_code=systemctl_exit)
    assert code == 0 and calls == ["systemctl stop trainbpf-health-job-4242.timer"]


@contextlib.contextmanager
def job_cgroup(job: str):
    """A Slurm-like job cgroup with one step, made for real: under the v1 pids hierarchy
    (ROOT/slurm/uid_0/job_ID/step_0), else cgroup v2 (ROOT/system.slice/
    slurmstepd.scope/job_ID/step_0).  Yields (the root to give the prolog, the step)."""
    v1 = Path("/sys/fs/cgroup/pids")
    base = v1 if (v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    root = base / f"trainbpf-test-{uuid.uuid4().hex[:8]}"
    job_dir = root / ("slurm/uid_0" if base == v1 else "system.slice/slurmstepd.scope") / f"job_{job}"
    step = job_dir / "step_0"
    step.mkdir(parents=True)
    try:
        yield root, step
    finally:
        for d in sorted([p for p in root.rglob("*") if p.is_dir()], key=lambda p: len(p.parts), reverse=True) + [root]:
            d.rmdir()


def test_job_check_runs_while_the_jobs_cgroup_holds_a_process(slurm):
    require_root("makes a cgroup")
    host = socket.gethostname()
    with job_cgroup("4242") as (root, step):
        task = subprocess.Popen(["sleep", "60"])
        try:
            (step / "cgroup.procs").write_text(str(task.pid))
            code, calls, stderr = slurm(PROLOG, "--job-check", "4242", job=None, exit_code=2, TRAINBPF_SLURM_CGROUPS=str(root))
            assert (code, calls) == (2, [f"trainbpf-health --textfile-dir /var/lib/prometheus/node-exporter "
                                         f"--json {slurm.shared}/{host}.json"]), stderr
            # Another job's check finds no cgroup of its own: nothing to check.
            assert slurm(PROLOG, "--job-check", "77", job=None, TRAINBPF_SLURM_CGROUPS=str(root))[:2] == (0, [])
        finally:
            task.send_signal(signal.SIGKILL)
            task.wait()
        deadline = time.monotonic() + 5
        while (step / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        # The job ended before its check fired: the check does not run.
        assert slurm(PROLOG, "--job-check", "4242", job=None, TRAINBPF_SLURM_CGROUPS=str(root))[:2] == (0, [])
