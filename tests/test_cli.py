"""The command line as a user meets it: help, doctor, the live status line, sudo."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from kernel_env import require_root, which_or_fail
from trainbpf.tracefile import read_trace

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))


def test_help_lists_every_command_with_help_text():
    res = subprocess.run([TRAINBPF, "--help"], capture_output=True, text=True, check=True)
    for cmd in ("record", "analyze", "export", "doctor", "recover"):
        line = next((ln for ln in res.stdout.splitlines() if f" {cmd} " in ln), "")
        assert len(line.split(cmd, 1)[1].strip(" │")) > 10, f"{cmd} has no help text: {line!r}"


def test_doctor_checks_everything_and_passes_here():
    require_root()
    res = subprocess.run([TRAINBPF, "doctor"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("privileges", "bpf syscall", "tracefs", "kernel headers", "bcc", "tracepoints: sched",
                 "tracepoints: mm", "uprobes", "gpu sampling", "delay accounting", "probes load"):
        assert name in res.stdout, f"doctor does not report {name}"
    assert "recording can work on this machine" in res.stdout


def test_doctor_fails_without_tracefs(tmp_path):
    require_root()
    res = subprocess.run([TRAINBPF, "doctor"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRAINBPF_TRACEFS": str(tmp_path / "none")})
    assert res.returncode == 12
    assert "recording cannot work: tracefs" in res.stdout
    assert "fix: sudo mount -t tracefs" in res.stdout


def test_live_status_line_on_a_terminal(tmp_path):
    require_root()
    target = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    master, slave = pty.openpty()
    try:
        rec = subprocess.Popen([TRAINBPF, "record", "--pid", str(target.pid), "-d", "3", "-o",
                                str(tmp_path / "t.parquet")], stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        seen = b""
        end = time.time() + 60
        while rec.poll() is None and time.time() < end:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        rec.wait(timeout=30)
    finally:
        target.kill()
        target.wait()
        os.close(master)
    text = seen.decode(errors="replace")
    assert rec.returncode == 0, text
    updates = text.count("\rrecording") + text.count("\r\x1b[Krecording")
    assert updates >= 2, f"expected a status line updated each second: {text!r}"
    for word in ("events", "lost", "written", "MB"):
        assert word in text


def test_record_under_sudo_with_the_documented_invocation(tmp_path):
    require_root()
    sudo = which_or_fail("sudo", "sudo")
    target = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    out = tmp_path / "t.parquet"
    try:  # sudo resets PATH: the README says to give the venv's trainbpf by full path
        res = subprocess.run([sudo, "-n", TRAINBPF, "record", "--pid", str(target.pid), "-d", "1", "-o", str(out)],
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    finally:
        target.kill()
        target.wait()
    assert res.returncode == 0, res.stderr
    assert read_trace(out).meta["complete"] is True
