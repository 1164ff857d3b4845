"""Where bcc finds the kernel headers, for the recorder and for the benchmarks' bcc
tools alike (issue 34 item 11): the running kernel's own Debian headers (a build folder
and a source folder) are used as they are, never pointed at by BCC_KERNEL_SOURCE."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bench_modules import bench_module

from trainbpf.tracer import kheaders

RELEASE = "6.1.0-99-amd64"


def _benchlib():
    """scripts/bench/benchlib.py, as the benchmark scripts import it."""
    return bench_module("benchlib")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A Debian machine in `tmp_path`: one header package, split into its arch folder
    (generated headers) and its -common folder; a stale BCC_KERNEL_SOURCE set."""
    src = tmp_path / "usr" / "src"
    arch, common = src / f"linux-headers-{RELEASE}", src / "linux-headers-6.1.0-99-common"
    (arch / "include" / "generated").mkdir(parents=True)
    (common / "include" / "linux").mkdir(parents=True)
    (common / "include" / "linux" / "sched.h").write_text("")
    monkeypatch.setattr(kheaders, "SRC_ROOT", src)
    monkeypatch.setattr(kheaders, "MODULES_ROOT", tmp_path / "lib" / "modules", raising=False)
    monkeypatch.setattr(kheaders, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(kheaders.platform, "release", lambda: RELEASE)
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path / "stale"))
    return tmp_path, arch, common


def test_the_running_kernels_split_headers_leave_bcc_to_find_them(machine):
    tmp_path, arch, common = machine
    modules = tmp_path / "lib" / "modules" / RELEASE
    modules.mkdir(parents=True)
    (modules / "build").symlink_to(arch)  # as linux-headers-K-amd64 installs them
    (modules / "source").symlink_to(common)
    env = _benchlib().bcc_env()
    assert "BCC_KERNEL_SOURCE" not in env, env.get("BCC_KERNEL_SOURCE")
    headers = kheaders.use_headers()
    assert headers.exact and headers.path == modules / "build"
    assert "BCC_KERNEL_SOURCE" not in os.environ
    assert not (tmp_path / "cache").exists()  # no merged tree built


def test_the_benchmarks_environment_is_the_recorders(machine):
    """Other kernels' headers: the merged tree, for the recorder and the bcc tools both."""
    tmp_path, arch, _ = machine
    env = _benchlib().bcc_env()
    kheaders.use_headers()  # what the recorder's loader does before compiling
    assert env["BCC_KERNEL_SOURCE"] == os.environ["BCC_KERNEL_SOURCE"] == str(
        tmp_path / "cache" / f"kernel-headers-{arch.name}")
    assert env == dict(os.environ)
