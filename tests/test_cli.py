"""The command line as a user meets it: help, one-line usage errors, doctor, the live status
line, sudo."""

from __future__ import annotations

import importlib.util
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel_env import require_root, which_or_fail, without_cap_syslog
from trainbpf.trace.reader import read_trace
from trainbpf.tracer.collectors.cuda import CALLS as CUDA_CALLS

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))
ROOT = Path(__file__).resolve().parents[1]


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
    for name in ("privileges", "bpf syscall", "tracefs", "kernel headers", "bcc", "kernel symbols",
                 "tracepoints: sched", "tracepoints: mm", "fault counters", "uprobes", "gpu sampling",
                 "delay accounting", "probes load"):
        assert name in res.stdout, f"doctor does not report {name}"
    assert "recording can work on this machine" in res.stdout


def test_doctor_fails_without_tracefs(tmp_path):
    require_root()
    res = subprocess.run([TRAINBPF, "doctor"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRAINBPF_TRACEFS": str(tmp_path / "none")})
    assert res.returncode == 12
    assert "recording cannot work: tracefs" in res.stdout
    assert "fix: sudo mount -t tracefs" in res.stdout


def test_doctor_fails_where_kernel_addresses_are_hidden():
    """Without CAP_SYSLOG /proc/kallsyms shows every address as 0 and a recording spent
    its time naming kernel frames; doctor now says so."""
    res = subprocess.run([*without_cap_syslog(), TRAINBPF, "doctor", "--no-load"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 12, res.stdout + res.stderr
    assert "recording cannot work: kernel symbols" in res.stdout, res.stdout
    assert "fix: run as root with CAP_SYSLOG" in res.stdout, res.stdout


def test_doctor_without_root_says_what_it_cannot_see():
    """issue 34 item 6: as a plain user, tracefs and its tracepoints were a PermissionError
    traceback; each check now says what it could not read."""
    require_root("becomes another user")
    setpriv = which_or_fail("setpriv", "util-linux")
    res = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", TRAINBPF, "doctor"],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert res.returncode == 12 and res.stderr == "", res.stderr
    for name in ("privileges", "bpf syscall", "tracefs", "kernel headers", "bcc", "tracepoints", "fault counters",
                 "uprobes", "gpu sampling", "delay accounting", "pressure (PSI)"):
        assert any(line.startswith(name) for line in res.stdout.splitlines()), f"doctor does not report {name}"
    for line in res.stdout.splitlines():
        if "not checked" in line:
            assert " WARN " in line and "is not readable by this user" in line or "without privileges" in line, line
    assert res.stdout.endswith("recording cannot work: privileges\n")


@pytest.mark.parametrize("option, value, words", [
    ("--min-block-us", "1e30", "--min-block-us 1e+30: must be from 0 to 3600000000 microseconds"),
    ("--min-futex-us", "-1", "--min-futex-us -1: must be from 0 to 3600000000 microseconds"),
    ("--min-lock-us", "inf", "--min-lock-us inf: must be from 0 to 3600000000 microseconds"),
    ("--min-cuda-us", "nan", "--min-cuda-us nan: must be from 0 to 3600000000 microseconds"),
    ("--ringbuf-pages", "1073741824", "--ringbuf-pages 1073741824: must be a power of two from 1 to 16384 pages"),
    ("--ringbuf-pages", "3", "--ringbuf-pages 3: must be a power of two from 1 to 16384 pages"),
    ("--oncpu-hz", "1000000000", "--oncpu-hz 1000000000: must be from 1 to 10000 samples per second"),
    ("--oncpu-hz", "0", "--oncpu-hz 0: must be from 1 to 10000 samples per second"),
])
def test_absurd_record_options_are_refused_up_front(option, value, words):
    """issue 34 item 10: they failed as "loading the probes failed... run doctor", after
    the compile; now a usage error (2) before anything is loaded, stating the range."""
    res = subprocess.run([TRAINBPF, "record", "--pid", str(os.getpid()), option, value, "-o", "/nonexistent/t.parquet"],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr) == (2, f"trainbpf: error: {words}\n")


def test_an_unknown_probe_is_a_usage_error_before_anything_is_recorded(tmp_path):
    out = tmp_path / "t.parquet"
    res = subprocess.run([TRAINBPF, "record", "--pid", str(os.getpid()), "--probes", "default,nosuch", "-o", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("trainbpf: error: unknown probe(s) nosuch; choose from default, sched,"), res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []


def test_settings_check_their_ranges_where_they_are_declared():
    from trainbpf.trace.errors import UsageError
    from trainbpf.tracer.settings import Settings

    with pytest.raises(UsageError, match=r"^--oncpu-hz 20000: must be from 1 to 10000 samples per second$"):
        Settings(oncpu_hz=20000)
    with pytest.raises(UsageError, match=r"^--min-block-us 10000000000: must be from 0 to 3600000000 microseconds$"):
        Settings(min_block_ns=10**13)
    with pytest.raises(UsageError, match=r"^stack_frames 128: must be from 1 to 127$"):
        Settings(stack_frames=128)
    assert Settings.from_options(min_block_us=2.5, oncpu_hz=99).min_block_ns == 2500


def test_doctor_pid_lists_cuda_libraries_per_process(tmp_path):
    """A plain parent whose child loaded the stand-in CUDA runtime through ctypes (and, by
    its rpath, the driver): doctor --pid lists both libraries and their probed symbols
    for the child, and no CUDA library for the parent."""
    require_root()
    spec = importlib.util.spec_from_file_location("fake_cuda_build", ROOT / "scripts" / "fake-cuda" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    runtime = build.build(tmp_path / "wheel")
    child = f"import ctypes, os, sys; ctypes.CDLL({str(runtime)!r}); print(os.getpid(), flush=True); sys.stdin.read()"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               f"subprocess.run([sys.executable, '-c', {child!r}])"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())  # the child loaded it
        res = subprocess.run([TRAINBPF, "doctor", "--no-load", "--pid", str(parent.pid)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        listed = res.stdout.split("\nCUDA libraries of process ", 1)[1].splitlines()
        assert listed[0].startswith(f"{parent.pid} and its 1 descendant "), listed
        assert any(ln.startswith(f"  pid {parent.pid} (") and ln.endswith("): no CUDA library mapped") for ln in listed)
        at = next(i for i, ln in enumerate(listed) if ln.startswith(f"  pid {child_pid} ("))
        assert listed[at].endswith(")"), listed[at]  # libraries follow, indented
        libs = [ln.strip() for ln in listed[at + 1:]]
        rt = next(ln for ln in libs if ln.startswith(str(runtime)))
        # The stand-ins export 17 and 16 of the probed calls, some also as versioned twins.
        assert f": 20 probed symbols (17 of the {len(CUDA_CALLS)} calls):" in rt, rt
        assert any(f"cuda_driver/lib/libcuda.so.1: 19 probed symbols (16 of the {len(CUDA_CALLS)} calls)" in ln
                   for ln in libs), libs
        symbols = " ".join(libs)
        for sym in ("cudaLaunchKernel,", "cudaLaunchKernel_ptsz,", "cudaStreamSynchronize_ptsz", "cuMemAlloc_v2,"):
            assert sym in symbols, symbols
        assert "cudaGetDeviceCount" not in symbols  # exported, but not a probed call
    finally:
        parent.stdin.close()  # the child reads EOF and ends, then the parent
        try:
            parent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            parent.kill()
            parent.wait()


def test_doctor_without_pid_says_cuda_is_found_at_record_time_and_bad_pid_fails():
    res = subprocess.run([TRAINBPF, "doctor", "--no-load"], capture_output=True, text=True, timeout=120)
    assert "CUDA and NCCL probing available" in res.stdout and "doctor --pid PID" in res.stdout, res.stdout
    assert "CUDA libraries of process" not in res.stdout
    res = subprocess.run([TRAINBPF, "doctor", "--no-load", "--pid", "999999999"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 11 and res.stderr.count("\n") == 1 and "no such process: 999999999" in res.stderr, res.stderr


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
