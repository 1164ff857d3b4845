"""Files a root process writes for the sudo user, beyond recording (issue 15: S4, L1, M4,
M7): health outputs and lock, inputs and reports that are not regular files, and the
file helper's fallbacks.  Shared set-up in file_safety_env.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from file_safety_env import attacker, base, folder, target  # noqa: F401 - fixtures
from file_safety_env import TRAINBPF, assert_untouched, cli, one_line_error, victim_of
from trainbpf.trace.errors import OutputError
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import spool_path_for


# -- S4: health outputs and lock ----------------------------------------------------------

def test_s4_health_outputs_and_lock_do_not_follow_planted_symlinks(folder, base, attacker):
    from trainbpf.health.config import TEXTFILE_NAME
    from trainbpf.health.outputs import write_atomic
    from trainbpf.health.run import exclusive_lock

    victim = victim_of(base)
    textfile = folder / TEXTFILE_NAME

    def plant() -> None:
        # the names the old code used (.NAME.PID.tmp with this process's pid), the JSON
        # document itself, and the lock file
        os.symlink(victim, folder / f".{TEXTFILE_NAME}.{os.getppid()}.tmp")
        os.symlink(victim, folder / "health.json")
        os.symlink(victim, folder / "health.lock")

    attacker.run(plant)
    write_atomic(textfile, "metrics 1\n")
    assert textfile.read_text() == "metrics 1\n" and not textfile.is_symlink()
    assert textfile.stat().st_mode & 0o777 == 0o644
    with pytest.raises(OutputError, match="symbolic link"):
        write_atomic(folder / "health.json", "{}\n")
    with pytest.raises(OutputError, match="symbolic link"):
        with exclusive_lock(folder / "health.lock"):
            pass
    assert_untouched(victim)


def test_s4_lock_file_that_is_not_our_own_is_refused(folder, attacker):
    from trainbpf.health.run import exclusive_lock

    lock = folder / "health.lock"
    attacker.run(lambda: lock.write_text("mine\n"))
    with pytest.raises(OutputError, match="not a plain file of uid 0"):
        with exclusive_lock(lock):
            pass
    assert lock.read_text() == "mine\n"


# -- L1: a killed health run's scratch -----------------------------------------------------

def test_l1_killed_health_runs_leave_nothing_behind(tmp_path, target):
    from test_health_kernel import write_config

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    out = tmp_path / "out"
    out.mkdir()
    trace = tmp_path / "health-trace.parquet"
    plain = write_config(tmp_path)
    kept = tmp_path / "kept.toml"
    kept.write_text(f'trace_file = "{trace}"\n' + plain.read_text())

    def killed(config: Path, spool_at: Callable[[], Path | None]) -> None:
        proc = subprocess.Popen([TRAINBPF, "health", "--pid", str(target), "--duration", "60", "--config", str(config),
                                 "--textfile-dir", str(out)], env={**os.environ, **env},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.time() + 60
        while (spool := spool_at()) is None or not spool.exists():
            assert time.time() < end and proc.poll() is None, "the health run never started recording"
            time.sleep(0.05)
        proc.kill()
        proc.wait()

    def temp_spool() -> Path | None:
        found = list(scratch.glob("trainbpf-health-*/trace.parquet.spool"))
        return found[0] if found else None

    killed(plain, temp_spool)
    assert list(scratch.iterdir())
    killed(kept, lambda: spool_path_for(trace))  # which clears the first one's folder
    assert list(scratch.iterdir()) == [], "a killed run's temporary folder was left behind"
    assert spool_path_for(trace).exists()
    res = cli("health", "--pid", str(target), "--duration", "1", "--config", str(kept), "--textfile-dir", str(out), env=env)
    assert res.returncode in (0, 1, 2), res.stderr
    assert not spool_path_for(trace).exists() and read_trace(trace).meta["complete"] is True


# -- M4: inputs that are not regular files -------------------------------------------------

def test_m4_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "t.parquet"
    os.mkfifo(fifo)
    for args in (["analyze", fifo], ["export", fifo, "-o", tmp_path / "x.json"], ["recover", fifo]):
        res = cli(*args, timeout=60)
        one_line_error(res, 14, "not a regular file")


def test_m4_fifo_as_report_output_is_refused(tmp_path):
    from synth import input_pipeline

    trace = input_pipeline().write(tmp_path / "t.parquet")
    fifo = tmp_path / "report.txt"
    os.mkfifo(fifo)
    for args in (["analyze", trace, "-o", fifo], ["export", trace, "-o", fifo]):
        one_line_error(cli(*args, timeout=60), 13, "not a regular file")
        one_line_error(cli(*args, "--force", timeout=60), 13, "not a regular file")


def test_reports_replace_an_existing_file_only_with_force(tmp_path):
    from synth import input_pipeline

    trace = input_pipeline().write(tmp_path / "t.parquet")
    report = tmp_path / "report.json"
    report.write_text("keep me")
    one_line_error(cli("analyze", trace, "--format", "json", "-o", report), 13, "give --force")
    assert report.read_text() == "keep me"
    res = cli("analyze", trace, "--format", "json", "-o", report, "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads(report.read_text())["schema"] == "trainbpf.report/3"


# -- M7: health without root ---------------------------------------------------------------

def test_m7_health_without_root_says_it_needs_root(attacker):
    res = subprocess.run([TRAINBPF, "health", "--duration", "1"], capture_output=True, text=True, timeout=60,
                         user=attacker.uid, group=attacker.gid, extra_groups=[], cwd="/",
                         env={**os.environ, "HOME": "/"})
    assert res.returncode == 3, res.stderr
    assert "root" in res.stderr and "Permission denied" not in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


# -- the helper's fallbacks (no root needed) ------------------------------------------------

def test_rename_noreplace_never_replaces(tmp_path):
    from trainbpf.trace.safefile import rename_noreplace

    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_text() == "b"
    rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]


def test_named_temporary_where_there_is_no_o_tmpfile(tmp_path, monkeypatch):
    from trainbpf.trace import safefile

    monkeypatch.setattr(safefile, "_unnamed", lambda folder, mode: None)
    out = tmp_path / "r.txt"
    safefile.write_new(out, lambda fh: fh.write(b"one"))
    with pytest.raises(OutputError, match="give --force"):
        safefile.write_new(out, lambda fh: fh.write(b"two"))
    safefile.write_new(out, lambda fh: fh.write(b"three"), force=True)
    assert out.read_bytes() == b"three" and out.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["r.txt"], "a temporary was left behind"
