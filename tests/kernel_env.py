"""Test helpers for the real-kernel tests: the root gate, and kernel settings that tests
change and always restore (dirty limits, a memory-limited cgroup)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest


def require_root(what: str = "loads BPF programs") -> None:
    """Skip without root, except in CI (CI=true), where a skip would hide a broken set-up."""
    if os.geteuid() == 0:
        return
    reason = f"needs root: this test {what}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI runs as root, so this set-up is broken")
    pytest.skip(reason)


def missing(reason: str) -> None:
    """Something scripts/setup.sh installs is missing: skip, except in CI, where a skip
    would hide a broken set-up."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def require_module(name: str, what: str) -> None:
    """Skip where module `name` is not installed, except in CI (scripts/setup.sh --test
    installs it)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        missing(f"{what} needs {name}, which is not installed (scripts/setup.sh --test installs it)")


# The CPython versions the Python-frame walk supports, as installed under pyenv here.
PYENV = Path("/root/.pyenv/versions")
PYTHON_VERSIONS = {"3.10": "3.10.13", "3.11": "3.11.7", "3.12": "3.12.1", "3.13": "3.13.0"}


def python_interpreter(version: str) -> str:
    """The pyenv CPython `version` ("3.12"); skipped where it is not installed, except
    in CI, where a missing interpreter is a broken set-up."""
    exe = PYENV / PYTHON_VERSIONS[version] / "bin" / "python3"
    if not exe.exists():
        reason = f"CPython {version} not installed at {exe}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return str(exe)


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


@contextlib.contextmanager
def dirty_limits(dirty_bytes: int, background_bytes: int):
    """Lower the dirty-page limits for a block, then restore them.

    Each limit is a bytes/ratio pair where writing one zeroes the other, and writing 0
    to a *_bytes file is refused, so restore whichever of the pair was in use."""
    pairs = {"vm.dirty_bytes": "vm.dirty_ratio", "vm.dirty_background_bytes": "vm.dirty_background_ratio"}
    saved = {k: _sysctl_path(k).read_text().strip() for pair in pairs.items() for k in pair}
    try:
        _sysctl_path("vm.dirty_background_bytes").write_text(str(background_bytes))
        _sysctl_path("vm.dirty_bytes").write_text(str(dirty_bytes))
        yield
    finally:
        for bytes_key, ratio_key in pairs.items():
            key = bytes_key if saved[bytes_key] != "0" else ratio_key
            _sysctl_path(key).write_text(saved[key])
        for key, val in saved.items():
            assert _sysctl_path(key).read_text().strip() == val, f"{key} not restored"


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh memory-limited cgroup (v2, else v1); yields the path of its procs file."""
    name = f"trainbpf-test-{uuid.uuid4().hex[:8]}"
    v2_root = Path("/sys/fs/cgroup")
    if "memory" in (v2_root / "cgroup.controllers").read_text(errors="ignore").split() if (v2_root / "cgroup.controllers").exists() else False:
        path = v2_root / name
        path.mkdir()
        (path / "memory.max").write_text(str(limit_bytes))
        (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
    else:
        path = v2_root / "memory" / name
        if not path.parent.is_dir():
            pytest.fail("no memory cgroup controller (v1 or v2) on this machine")
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
    try:
        yield path / "cgroup.procs"
    finally:
        parent_procs = path.parent / "cgroup.procs"
        for _ in range(50):
            pids = (path / "cgroup.procs").read_text().split()
            for p in pids:  # move stragglers out so the folder can go
                with contextlib.suppress(OSError):
                    parent_procs.write_text(p)
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def which_or_fail(exe: str, package: str) -> str:
    path = shutil.which(exe)
    if path is None:
        missing(f"{exe} not installed (Debian package {package}; scripts/setup.sh --test installs it)")
    return path


def without_cap_syslog() -> list[str]:
    """A command prefix that runs a command as root without CAP_SYSLOG (dropped from the
    bounding set, so root's exec does not regain it): /proc/kallsyms then shows every
    address as 0.  Skips where this kernel shows them anyway (kernel.kptr_restrict=0 with
    kernel.perf_event_paranoid <= 1)."""
    require_root("drops CAP_SYSLOG")
    prefix = [which_or_fail("setpriv", "util-linux"), "--bounding-set", "-syslog"]
    first = subprocess.run([*prefix, "grep", "-m1", " [Tt] ", "/proc/kallsyms"], capture_output=True, text=True)
    if not first.stdout.startswith("0" * 16 + " "):
        missing(f"kernel addresses are visible without CAP_SYSLOG here: {first.stdout.strip()!r}")
    return prefix


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
