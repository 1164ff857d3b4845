"""Paths the sudo user names are opened with that user's rights (issue 34: items 1, 2,
4 (files), 5, 6 (opening), 9 and 10 (a long -o)).  The attacker is a throwaway user
(file_safety_env.py) who may run `sudo trainbpf` and controls the paths it names; the
victims are root's own files and folders.

Needs root (useradd, BPF): without root these tests skip, except under CI=true."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from file_safety_env import attacker, base, folder, target  # noqa: F401 - fixtures
from file_safety_env import (SECRET, TRAINBPF, User, assert_untouched, cli, one_line_error, record_args, victim_of,
                             write_spool)
from test_health_kernel import write_config
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import spool_path_for

PROJECT = Path(__file__).resolve().parents[1]
IN_OPEN, IN_CREATE = 0x20, 0x100
RENAME_EXCHANGE = 2
AT_FDCWD = -100


# -- item 1: the output folder exchanged for a symlink to a root-only folder ----------------

def _exchange_on_tmpfile(watched: Path, other: Path, ready: int, swapped: int) -> Callable[[], None]:
    """The attacker's step: watch their folder `watched` with inotify and, when an
    unnamed temporary (O_TMPFILE: named "#<inode>" in events) is opened in it, exchange
    the folder with `other`, a symlink to a root-only folder (renameat2 RENAME_EXCHANGE).
    Writes to `ready` once watching and to `swapped` once exchanged."""
    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        ifd = libc.inotify_init1(0)
        assert ifd >= 0 and libc.inotify_add_watch(ifd, os.fsencode(watched), IN_OPEN | IN_CREATE) >= 0
        os.write(ready, b"r")
        while True:
            buf, at = os.read(ifd, 65536), 0
            while at < len(buf):
                _, mask, _, length = struct.unpack_from("iIII", buf, at)
                name = buf[at + 16:at + 16 + length].rstrip(b"\0")
                at += 16 + length
                if mask & IN_OPEN and name.startswith(b"#"):
                    res = libc.renameat2(AT_FDCWD, os.fsencode(watched), AT_FDCWD, os.fsencode(other), RENAME_EXCHANGE)
                    assert res == 0, os.strerror(ctypes.get_errno())
                    os.write(swapped, b"s")
                    return
    return run


def _race(attacker: User, folder: Path, base: Path, args: Callable[[Path], list],
          existing: str | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `trainbpf *args(out)` under sudo while the attacker exchanges `out` (their
    folder, holding their file `existing` if named) for a symlink to root-only; returns
    the result and where the real folder is now.  Asserts the exchange happened and
    that root-only is as it was."""
    out, other = folder / "out", folder / "other"
    root_only = base / "root-only"
    attacker.run(lambda: (out.mkdir(), os.symlink(root_only, other),
                          existing and (out / existing).write_bytes(b"an earlier output")))
    ready_r, ready_w = os.pipe()
    swapped_r, swapped_w = os.pipe()
    racer = attacker.start(_exchange_on_tmpfile(out, other, ready_w, swapped_w))
    try:
        assert os.read(ready_r, 1) == b"r"
        res = cli(*map(os.fsencode, args(out)), env=attacker.sudo)
    finally:
        os.kill(racer, signal.SIGKILL)
        os.waitpid(racer, 0)
    os.set_blocking(swapped_r, False)
    assert os.read(swapped_r, 1) == b"s", "the folder was never exchanged: the test proves nothing"
    for fd in (ready_r, ready_w, swapped_r, swapped_w):
        os.close(fd)
    assert out.is_symlink() and not other.is_symlink()
    assert sorted(os.listdir(root_only)) == ["victim"], "a file appeared in the root-only folder"
    assert_untouched(victim_of(base))
    return res, other


@pytest.mark.parametrize("name,force", [("t.parquet", False), ("victim", True)])
def test_item1_record_lands_in_the_folder_checked_when_it_is_exchanged(folder, base, attacker, target, name, force):
    # With --force, the user's own earlier output of the root-only file's name is replaced.
    res, real = _race(attacker, folder, base, lambda out: [*record_args(target, out / name), *(["--force"] if force else [])],
                      existing=name if force else None)
    assert res.returncode == 0, res.stderr
    trace = real / name
    assert read_trace(trace).meta["target_pid"] == target
    assert (trace.stat().st_uid, trace.stat().st_mode & 0o777) == (attacker.uid, 0o600)
    assert sorted(os.listdir(real)) == [name], "a spool or a temporary was left behind"
    assert f"wrote {trace}" in res.stderr.decode(), "record named another path than the file's"


@pytest.mark.parametrize("command", ["recover", "analyze", "export"])
def test_item1_recover_analyze_export_land_in_the_folder_checked(folder, base, attacker, command):
    from synth import input_pipeline

    trace = input_pipeline().write(base / "in.parquet")
    trace.chmod(0o644)
    spool = write_spool(folder / "t.parquet", 4242)
    os.chown(spool, attacker.uid, attacker.gid)

    def args(out: Path) -> list:
        if command == "recover":
            attacker.run(lambda: os.rename(spool, out / spool.name))
            return ["recover", out / spool.name]
        return [command, trace, "-o", out / "report.json", *(["--format", "json"] if command == "analyze" else [])]

    res, real = _race(attacker, folder, base, args)
    assert res.returncode == 0, res.stderr
    written = real / ("t.parquet" if command == "recover" else "report.json")
    assert written.stat().st_uid == attacker.uid
    assert sorted(os.listdir(real)) == [written.name]


# -- item 2: health's lock file -----------------------------------------------------------

@pytest.mark.parametrize("sudo", [True, False])
def test_item2_health_never_overwrites_a_file_named_as_its_lock(base, attacker, sudo):
    rootfile = base / "root-file"  # root's, readable by all: not the user's to write
    rootfile.write_bytes(SECRET)
    rootfile.chmod(0o644)
    config = base / "health.toml"
    config.write_text(f'lock_file = "{rootfile}"\ngpu = "off"\nduration_s = 1\n')
    config.chmod(0o644)
    res = cli("health", "--config", config, env=attacker.sudo if sudo else {})
    one_line_error(res, 3, f"lock file {rootfile}", "Permission denied" if sudo else "not ours to overwrite")
    assert rootfile.read_bytes() == SECRET and rootfile.stat().st_uid == 0


# -- item 4: inputs the sudo user could not read --------------------------------------------

def test_item4_root_only_trace_and_topology_are_refused_under_sudo(folder, base, attacker, target):
    from synth import input_pipeline

    hidden = input_pipeline().write(base / "root-only" / "t.parquet")
    hidden.chmod(0o644)  # readable by mode, inside a 0700 root folder
    for args in (["analyze", hidden, "-o", folder / "r.txt"], ["export", hidden, "-o", folder / "r.json"]):
        one_line_error(cli(*args, env=attacker.sudo), 14, "Permission denied")
    topology = base / "root-only" / "topo.json"
    topology.write_text(json.dumps({"nodes": {"0": [0]}, "gpus": [], "secret": "x"}))
    topology.chmod(0o644)
    res = cli(*record_args(target, folder / "t.parquet"), "--topology", topology, env=attacker.sudo)
    one_line_error(res, 2, f"--topology {topology}", "Permission denied")
    assert os.listdir(folder) == [], "root-only data was copied into the user's folder"


# -- item 5: health under sudo ---------------------------------------------------------------

def test_item5_health_under_sudo_checks(base, attacker, target):
    home = base / "home"
    home.mkdir()
    os.chown(home, attacker.uid, attacker.gid)
    config = write_config(home)
    res = subprocess.run([PROJECT / "scripts" / "trainbpf-health", "--pid", str(target), "--duration", "1"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, **attacker.sudo, "TRAINBPF": TRAINBPF, "TRAINBPF_HEALTH_CONFIG": str(config)})
    assert res.returncode in (0, 1, 2), res.stderr
    assert (home / "health.lock").stat().st_uid == attacker.uid


# -- item 6: a topology or config that is not a small regular file -------------------------

def test_item6_fifo_device_or_huge_topology_and_config_are_refused_at_once(tmp_path, target):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (2 << 20))
    cases = [(fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"), (huge, "larger than")]
    for path, why in cases:
        start = time.monotonic()
        res = cli(*record_args(target, tmp_path / "t.parquet"), "--topology", path, timeout=30)
        one_line_error(res, 2, f"--topology {path}", why)
        one_line_error(cli("health", "--config", path, timeout=30), 3, f"config {path}", why)
        assert time.monotonic() - start < 20
    assert sorted(os.listdir(tmp_path)) == ["fifo", "huge.json"]


# -- item 9: an empty spool ------------------------------------------------------------------

def test_item9_an_empty_spool_is_removed_by_record_and_named_by_recover(tmp_path, target):
    out = tmp_path / "t.parquet"
    spool = spool_path_for(out)
    spool.write_bytes(b"")
    one_line_error(cli("recover", spool), 14, "empty spool")
    res = cli(*record_args(target, out))
    assert res.returncode == 0, res.stderr
    assert f"removed the empty spool {spool}" in res.stderr.decode()
    assert read_trace(out).meta["target_pid"] == target and not spool.exists()


def test_item9_disk_full_at_the_spool_header_leaves_no_spool(tmp_path, target):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", str(small)], check=True)
    try:
        with open(small / "filler", "wb", buffering=0) as fh:
            with pytest.raises(OSError):
                while True:
                    fh.write(b"x" * 4096)
        res = cli(*record_args(target, small / "t.parquet"))
        left = sorted(os.listdir(small))
    finally:
        subprocess.run(["umount", str(small)], check=True)
    one_line_error(res, 13, "disk full")
    assert left == ["filler"], "an empty spool was left behind"


# -- item 10: a -o name too long for its spool -------------------------------------------------

def test_item10_too_long_output_name_is_said_so(tmp_path, target):
    out = tmp_path / ("t" * 250)  # fits, but not with .spool
    one_line_error(cli(*record_args(target, out)), 13, "name is too long")
    one_line_error(cli(*record_args(target, tmp_path / ("t" * 300))), 13, "name is too long")
    assert os.listdir(tmp_path) == []


# -- the helper itself ------------------------------------------------------------------------

def _helpers(uid: int, parent: int | None = None) -> list[int]:
    """Processes of `uid` running the helper (children of `parent`, if given)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and b"trainbpf.trace.asuser" in Path(f"/proc/{entry}/cmdline").read_bytes() \
                    and Path(f"/proc/{entry}").stat().st_uid == uid \
                    and parent in (None, int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])):
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_helper_opens_as_the_sudo_user_and_ends_with_its_command(attacker):
    """Under sudo one helper, running as the sudo user, opens what is named; it ends
    with the process it serves (its socket closes)."""
    code = ("import os, sys\nfrom test_file_safety_sudo import _helpers\nfrom trainbpf.trace.safefile import read_small\n"
            "read_small('/etc/hostname', 'x')\nprint(len(_helpers(int(sys.argv[1]), os.getpid())))\n")
    res = subprocess.run([str(Path(TRAINBPF).with_name("python")), "-c", code, str(attacker.uid)], capture_output=True,
                         text=True, env={**os.environ, **attacker.sudo, "PYTHONPATH": str(PROJECT / "tests")}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1", "no helper of the sudo user's opened the file"
    time.sleep(0.5)
    assert _helpers(attacker.uid) == [], "a helper outlived its command"
