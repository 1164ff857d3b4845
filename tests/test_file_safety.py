"""Files a root process writes for the sudo user (issue 15: S1-S3, S5, D1, D2, D5;
S4, L1, M4 and M7: test_file_safety_reports.py).  The attacks run as a throwaway
unprivileged user created in file_safety_env.py, planting in a sticky /tmp-like folder
and in a folder that user owns; the victims are root's own files.

Needs root (useradd, BPF): without root these tests skip, except under CI=true, where
they fail (kernel_env.require_root)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from file_safety_env import attacker, base, folder, target  # noqa: F401 - fixtures
from file_safety_env import (SECRET, TRAINBPF, assert_untouched, cli, one_line_error, record_args, victim_of,
                             wait_for, write_spool)
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import spool_path_for


# -- S1: planted symlinks -------------------------------------------------------------

def test_s1_symlink_planted_at_the_temporary_name_is_not_followed(folder, base, attacker, target):
    out = folder / "t.parquet"
    victim = victim_of(base)
    attacker.run(lambda: os.symlink(victim, folder / "t.parquet.tmp"))
    res = cli(*record_args(target, out), env=attacker.sudo)
    assert res.returncode == 0, res.stderr
    assert_untouched(victim)
    st = out.lstat()
    assert (st.st_uid, st.st_mode & 0o777) == (attacker.uid, 0o600)
    assert read_trace(out).meta["target_pid"] == target
    assert (folder / "t.parquet.tmp").is_symlink()  # left alone, never used


def test_s1_symlink_planted_at_the_spool_is_refused(folder, base, attacker, target):
    out = folder / "t.parquet"
    victim = victim_of(base)
    attacker.run(lambda: os.symlink(victim, folder / "t.parquet.spool"))
    one_line_error(cli(*record_args(target, out), env=attacker.sudo), 13, "not a regular file")
    assert_untouched(victim)
    assert not out.exists()


# -- S2: names swapped while the recorder works ------------------------------------------

def _swap_temporaries(folder: Path, victim: Path) -> Callable[[], None]:
    """Forever: rename any temporary file away and plant a symlink to `victim` in its place."""
    def loop() -> None:
        while True:
            for entry in os.scandir(folder):
                if entry.name.endswith(".tmp") and not entry.is_symlink():
                    with contextlib.suppress(OSError):
                        os.rename(entry.path, folder / f"stolen-{entry.name}")
                        os.symlink(victim, entry.path)
            time.sleep(0.001)
    return loop


def test_s2_temporary_swapped_for_a_symlink_during_the_recording(folder, base, attacker, target):
    out = folder / "t.parquet"
    victim = victim_of(base)
    thief = attacker.start(_swap_temporaries(folder, victim))
    try:
        res = cli(*record_args(target, out, 2), env=attacker.sudo)
    finally:
        os.kill(thief, signal.SIGKILL)
        os.waitpid(thief, 0)
    assert_untouched(victim)
    assert res.returncode == 0, res.stderr
    assert read_trace(out).meta["target_pid"] == target


# -- S3: -o at something that must not be replaced -----------------------------------------

@pytest.mark.parametrize("force", [False, True])
def test_s3_output_never_replaces_a_file_the_sudo_user_could_not_write(base, attacker, target, force):
    victim = victim_of(base)
    res = cli(*record_args(target, victim), *(["--force"] if force else []), env=attacker.sudo)
    one_line_error(res, 13, str(victim.parent))
    assert_untouched(victim)
    # The user's own folder, a file in it that is not theirs to write:
    mine = base / "mine"
    mine.mkdir()
    os.chown(mine, attacker.uid, attacker.gid)
    theirs = mine / "root-file"
    theirs.write_bytes(SECRET)
    theirs.chmod(0o644)
    res = cli(*record_args(target, theirs), "--force", env=attacker.sudo)
    one_line_error(res, 13, "not replaceable by uid")
    assert theirs.read_bytes() == SECRET


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_s3_output_is_never_a_device_or_fifo(tmp_path, target, force, kind):
    node = tmp_path / kind  # our own nodes: a test must not risk the real /dev/full
    if kind == "device":
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # like /dev/full
    else:
        os.mkfifo(node)
    res = cli(*record_args(target, node), *(["--force"] if force else []), timeout=60)
    one_line_error(res, 13, "not a regular file")
    assert node.is_char_device() if kind == "device" else node.is_fifo()


def test_s3_existing_output_needs_force(tmp_path, target):
    out = tmp_path / "t.parquet"
    out.write_bytes(b"an earlier trace")
    one_line_error(cli(*record_args(target, out)), 13, "exists; give --force")
    assert out.read_bytes() == b"an earlier trace"
    res = cli(*record_args(target, out), "--force")
    assert res.returncode == 0, res.stderr
    assert read_trace(out).meta["target_pid"] == target


# -- S5: the spool swapped mid-run --------------------------------------------------------

@pytest.mark.parametrize("swap", ["another recording", "symlink to a root-only file"])
def test_s5_finalize_uses_the_spool_it_wrote(base, attacker, target, swap):
    home = base / "home"
    home.mkdir()
    os.chown(home, attacker.uid, attacker.gid)
    out = home / "t.parquet"
    decoy = write_spool(home / "decoy.parquet", 4242)
    os.chown(decoy, attacker.uid, attacker.gid)
    victim = victim_of(base)
    spool = spool_path_for(out)

    def swap_it() -> None:
        wait_for(spool)
        time.sleep(0.5)
        os.rename(spool, home / "moved.spool")
        if swap == "another recording":
            os.rename(decoy, spool)
        else:
            os.symlink(victim, spool)

    rec = subprocess.Popen([TRAINBPF, *map(str, record_args(target, out, 3))], stderr=subprocess.PIPE,
                           env={**os.environ, **attacker.sudo})
    attacker.run(swap_it)
    _, err = rec.communicate(timeout=120)
    assert rec.returncode == 0, err
    assert SECRET[:4] not in err
    meta = read_trace(out).meta
    assert meta["target_pid"] == target and meta["complete"] is True
    assert_untouched(victim)
    assert os.path.lexists(spool), "the swapped-in file is not ours to remove"


# -- D1, D2: one -o, one recording ---------------------------------------------------------

def test_d1_second_recorder_on_the_same_output_refuses_naming_the_first(tmp_path, target):
    out = tmp_path / "t.parquet"
    first = subprocess.Popen([TRAINBPF, *map(str, record_args(target, out, 5))], stderr=subprocess.PIPE)
    try:
        wait_for(spool_path_for(out))
        t0 = time.monotonic()
        res = cli(*record_args(target, out, 1))
        line = one_line_error(res, 13, f"another recorder (pid {first.pid})")
        assert time.monotonic() - t0 < 10, "refused only after compiling the probes"
        assert str(spool_path_for(out)) in line
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    trace = read_trace(out)
    assert trace.duration_ns >= 4.5e9, "the first recording was cut short"


def test_d2_an_unrecovered_spool_is_kept_and_recover_is_suggested(tmp_path, target):
    out = tmp_path / "t.parquet"
    spool = spool_path_for(out)
    first = subprocess.Popen([TRAINBPF, *map(str, record_args(target, out, 60))], stderr=subprocess.DEVNULL)
    wait_for(spool)
    time.sleep(2.5)
    first.kill()
    first.wait()
    size = spool.stat().st_size
    rows = read_trace(spool).num_rows
    line = one_line_error(cli(*record_args(target, out, 1)), 13, "trainbpf recover")
    assert str(spool) in line
    assert spool.stat().st_size == size
    one_line_error(cli(*record_args(target, out, 1), "--force"), 13, "trainbpf recover")
    res = cli("recover", str(spool))
    assert res.returncode == 0, res.stderr
    assert read_trace(out).num_rows == rows


# -- D5: a -o name that is not UTF-8 -------------------------------------------------------

def test_d5_non_utf8_output_records_finalises_and_recovers(tmp_path, target):
    folder = os.fsencode(tmp_path)
    out = folder + b"/t\xff\xfe.parquet"
    res = cli(*record_args(target, out))
    assert res.returncode == 0, res.stderr
    assert os.listdir(folder) == [b"t\xff\xfe.parquet"]
    assert read_trace(os.fsdecode(out)).meta["target_pid"] == target
    left = folder + b"/left\xff.parquet"
    write_spool(Path(os.fsdecode(left)), 77)
    res = cli("recover", left + b".spool")
    assert res.returncode == 0, res.stderr
    assert read_trace(os.fsdecode(left)).meta["recovered"] is True
    res = cli("analyze", left, "--format", "json")
    assert res.returncode == 0, res.stderr
