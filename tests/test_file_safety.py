"""Files a root process writes for the sudo user (issue 15: S1-S5, D1, D2, D5, L1, M4,
M7).  The attacks run as a throwaway unprivileged user created here, planting in a sticky
/tmp-like folder and in a folder that user owns; the victims are root's own files.

Needs root (useradd, BPF): without root these tests skip, except under CI=true, where
they fail (kernel_env.require_root)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from kernel_env import require_root
from trainbpf.errors import OutputError
from trainbpf.tracefile import SpoolWriter, make_batch, read_trace, spool_path_for

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))
SECRET = b"SECRET-root-only-content\n"


@dataclass
class User:
    name: str
    uid: int
    gid: int

    def run(self, fn: Callable[[], None]) -> None:
        """Run `fn` in a forked child that has become this user; fail if it raises."""
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                fn()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the attacker's step failed"

    def start(self, fn: Callable[[], None]) -> int:
        """Like run, in the background: the child's pid (stop it with os.kill)."""
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                fn()
            finally:
                os._exit(0)
        return pid

    @property
    def sudo(self) -> dict:
        return {"SUDO_UID": str(self.uid), "SUDO_GID": str(self.gid), "SUDO_USER": self.name}


@pytest.fixture(scope="module")
def attacker():
    require_root("creates a throwaway user")
    name = f"tbpf{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        import pwd

        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def base():
    """A root-owned 0755 folder outside pytest's private tree, so the attacker can reach
    the folders made in it; with a root-only victim file."""
    path = Path(tempfile.mkdtemp(prefix="trainbpf-sec-"))
    path.chmod(0o755)
    (path / "root-only").mkdir(mode=0o700)
    victim = path / "root-only" / "victim"
    victim.write_bytes(SECRET)
    victim.chmod(0o600)
    yield path
    shutil.rmtree(path)


@pytest.fixture(params=["sticky", "user-owned"])
def folder(request, base, attacker) -> Path:
    """Where the output goes: a sticky world-writable folder like /tmp, or the
    attacker's own folder (their home)."""
    path = base / request.param
    path.mkdir()
    if request.param == "sticky":
        path.chmod(0o1777)
    else:
        os.chown(path, attacker.uid, attacker.gid)
        path.chmod(0o755)
    return path


def victim_of(base: Path) -> Path:
    return base / "root-only" / "victim"


def assert_untouched(victim: Path) -> None:
    st = victim.lstat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o600), "the root-only file changed hands"
    assert victim.read_bytes() == SECRET, "the root-only file was written"


@pytest.fixture
def target():
    require_root()
    proc = subprocess.Popen(["sleep", "120"])
    yield proc.pid
    proc.kill()
    proc.wait()


def cli(*args, env: dict | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINBPF, *args], capture_output=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})}, timeout=timeout, **kw)


def one_line_error(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    err = res.stderr.decode(errors="replace")
    assert res.returncode == code, f"exit {res.returncode}, expected {code}: {err}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trainbpf: error: "), err
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    return lines[0]


def record_args(pid: int, out: Path | bytes, seconds: float = 1) -> list:
    return ["record", "--pid", str(pid), "-d", str(seconds), "--gpu", "off", "--probes", "sched", "-o", out]


def wait_for(path: Path, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not os.path.lexists(path):
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.02)


def write_spool(out: Path, pid: int, *, close: bool = True) -> Path:
    """A small spool of a recording of `pid`, as a recorder writes it."""
    writer = SpoolWriter(out, {"schema": "trainbpf.trace/1", "target_pid": pid,
                               "clock": {"start_mono_ns": 10**12}, "complete": False})
    writer.add(make_batch("thread", {"ts_ns": [10**12], "tid": [pid], "pid": [pid], "comm": ["decoy"], "name": ["seed"]}))
    writer.add(make_batch("offcpu", {"ts_ns": [10**12 + 10**8], "dur_ns": [10**8], "tid": [pid], "pid": [pid], "state": ["S"]}))
    writer.flush()
    writer.close()
    return spool_path_for(out)


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


# -- S4: health outputs and lock ----------------------------------------------------------

def test_s4_health_outputs_and_lock_do_not_follow_planted_symlinks(folder, base, attacker):
    from trainbpf.health import TEXTFILE_NAME, exclusive_lock, write_atomic

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
    from trainbpf.health import exclusive_lock

    lock = folder / "health.lock"
    attacker.run(lambda: lock.write_text("mine\n"))
    with pytest.raises(OutputError, match="not a plain file of uid 0"):
        with exclusive_lock(lock):
            pass
    assert lock.read_text() == "mine\n"


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
    assert json.loads(report.read_text())["schema"] == "trainbpf.report/1"


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
    from trainbpf.safefile import rename_noreplace

    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_text() == "b"
    rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]


def test_named_temporary_where_there_is_no_o_tmpfile(tmp_path, monkeypatch):
    from trainbpf import safefile

    monkeypatch.setattr(safefile, "_unnamed", lambda folder, mode: None)
    out = tmp_path / "r.txt"
    safefile.write_new(out, lambda fh: fh.write(b"one"))
    with pytest.raises(OutputError, match="give --force"):
        safefile.write_new(out, lambda fh: fh.write(b"two"))
    safefile.write_new(out, lambda fh: fh.write(b"three"), force=True)
    assert out.read_bytes() == b"three" and out.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["r.txt"], "a temporary was left behind"
