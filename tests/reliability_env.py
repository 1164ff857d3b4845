"""What the reliability tests share: a busy target, the recorder as a command, and the
BPF programs and perf events it holds."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kernel_env import which_or_fail

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))
PROJECT = Path(__file__).resolve().parents[1]
OUR_PROGRAMS = ("tracepoint__", "on_cpu_sample")

# A target that keeps every probe busy: futex hand-offs, sleeps, faults, mmaps.
BUSY_TARGET = r"""
import mmap, queue, sys, threading, time
q = queue.Queue()
def worker():
    while True:
        time.sleep(0.002)
        q.put(1)
threading.Thread(target=worker, daemon=True, name="worker").start()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    q.get()
    m = mmap.mmap(-1, 1 << 20); m[0] = 1; m.close()
"""


def start_target(seconds: float = 60, *, user: int | None = None) -> subprocess.Popen:
    """The busy target, as root or as uid `user` (its gid the same number)."""
    as_user = {} if user is None else {"user": user, "group": user, "extra_groups": []}
    proc = subprocess.Popen([sys.executable, "-c", BUSY_TARGET, str(seconds)], stdout=subprocess.PIPE, text=True,
                            **as_user)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def loaded_program_ids() -> set[int]:
    """Ids of every BPF program loaded in the kernel, as bpftool lists them."""
    bpftool = which_or_fail("bpftool", "bpftool")
    # plain `bpftool prog show` can print nothing on this kernel; -d lists them
    out = subprocess.run([bpftool, "-j", "-d", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["id"] for p in json.loads(out or "[]") if p.get("name", "").startswith(OUR_PROGRAMS)}


def held_program_ids(pid: int) -> set[int]:
    """BPF programs a process holds open (its fdinfo names them), and how many perf
    events it holds, so a test can later check exactly those are gone."""
    ids = set()
    fdinfo = Path(f"/proc/{pid}/fdinfo")
    for entry in fdinfo.iterdir():
        with contextlib.suppress(OSError):
            for line in entry.read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
    return ids


def perf_event_fds(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            n += os.readlink(fd) == "anon_inode:[perf_event]"
    return n


def wait_until_detached(ids: set[int], timeout: float = 5) -> set[int]:
    """Program ids from `ids` still loaded after `timeout` (the kernel frees them lazily)."""
    end = time.time() + timeout
    while (left := ids & loaded_program_ids()) and time.time() < end:
        time.sleep(0.1)
    return left


def wait_for(path: Path, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not path.exists():
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINBPF, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})}, timeout=180, **kw)


def assert_one_line_error(res: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert res.returncode == code, f"exit {res.returncode}, expected {code}: {res.stderr}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got: {res.stderr!r}"
    assert lines[0].startswith("trainbpf: error: ")
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
