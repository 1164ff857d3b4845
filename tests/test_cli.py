"""The command line as a user meets it: help, one-line usage errors, doctor, the live status
line, sudo."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel_env import require_root, which_or_fail
from trainbpf.tracefile import read_trace

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))


COMMANDS = ("record", "analyze", "export", "doctor", "recover", "health", "fleet")


def test_help_lists_every_command_with_help_text():
    from trainbpf.cli import app

    assert {c.name or c.callback.__name__ for c in app.registered_commands} == set(COMMANDS)
    res = subprocess.run([TRAINBPF, "--help"], capture_output=True, text=True, check=True)
    for cmd in COMMANDS:
        line = next((ln for ln in res.stdout.splitlines() if f" {cmd} " in ln), "")
        assert len(line.split(cmd, 1)[1].strip(" │")) > 10, f"{cmd} has no help text: {line!r}"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_and_option_has_help(cmd):
    """`trainbpf CMD --help` exits 0, says what the command does, and every option
    says what it is for (typer prints an option's help beside its name)."""
    from trainbpf.cli import app
    import typer.main

    command = typer.main.get_command(app).commands[cmd]
    assert len((command.help or "").strip()) > 20, f"{cmd}: no command help"
    for param in command.params:
        if param.param_type_name == "option" and param.name != "help":
            assert len((param.help or "").strip()) > 10, f"{cmd} {param.opts}: no help text"
    res = subprocess.run([TRAINBPF, cmd, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "Usage:" in res.stdout and (command.help or "").split()[0] in res.stdout


def test_help_exits_0_and_no_arguments_prints_help():
    assert subprocess.run([TRAINBPF, "analyze", "--help"], capture_output=True, text=True).returncode == 0
    res = subprocess.run([TRAINBPF], capture_output=True, text=True)
    assert "Commands" in res.stdout and res.returncode == 2


@pytest.mark.parametrize("args, words", [
    (["analyze", "--bogus", "x"], ("No such option: --bogus", "'trainbpf analyze --help'")),
    (["analyze"], ("Missing argument 'trace'", "'trainbpf analyze --help'")),
    (["analyze", "--format"], ("'--format' requires an argument", "'trainbpf analyze --help'")),
    (["record", "--pid", "abc"], ("'--pid'", "integer", "'trainbpf record --help'")),
    (["record", "--pid", "1", "--gpu", "bogus"], ("'--gpu'", "'bogus' is not one of", "'trainbpf record --help'")),
    (["analyze", "--trainer-tid", "x", "t.parquet"], ("'--trainer-tid'", "integer")),
    (["bogus"], ("No such command 'bogus'", "'trainbpf --help'")),
])
def test_usage_errors_are_one_line(args, words):
    res = subprocess.run([TRAINBPF, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("trainbpf: error: ") and res.stdout == ""
    for word in words:
        assert word in lines[0]


def test_health_usage_error_is_one_line_and_exits_3():
    res = subprocess.run([TRAINBPF, "health", "--bogus"], capture_output=True, text=True)
    assert res.returncode == 3 and res.stderr.count("\n") == 1 and "--bogus" in res.stderr


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
