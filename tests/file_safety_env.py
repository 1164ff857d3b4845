"""What the file-safety tests share: a throwaway unprivileged attacker, root-only
victims, the folders they plant in, a target to record, and the recorder as a command."""

from __future__ import annotations

import os
import secrets
import shutil
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
from trainbpf.trace.spool import SpoolWriter, make_batch, spool_path_for

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
def target(attacker):
    """A process of the attacker's own: under sudo only processes the invoking user could
    ptrace are traced (tracer/access.py), and these tests are about files, not that."""
    require_root()
    proc = subprocess.Popen(["sleep", "120"], user=attacker.uid, group=attacker.gid, extra_groups=[])
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
    writer.add(make_batch("thread", {"ts_ns": [10**12], "tid": [pid], "pid": [pid], "comm": ["decoy"], "event": ["seed"]}))
    writer.add(make_batch("offcpu", {"ts_ns": [10**12 + 10**8], "dur_ns": [10**8], "tid": [pid], "pid": [pid], "state": ["S"]}))
    writer.flush()
    writer.close()
    return spool_path_for(out)
