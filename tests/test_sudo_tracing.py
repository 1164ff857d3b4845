"""Under sudo, what the recorder traces is what the invoking user could trace themselves
(issue 34, items 3 and 4; docs/security.md, "Whose processes are traced"): a throwaway
unprivileged user's processes, recorded with SUDO_UID/SUDO_GID set as sudo sets them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from file_safety_env import TRAINBPF, attacker, base, cli, one_line_error, wait_for  # noqa: F401 (fixtures)
from kernel_env import require_root
from trainbpf.trace.errors import TargetError
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import spool_path_for

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "/usr/bin/python3"  # one every user may run (the venv may live in a private folder)


def _home(base: Path, user) -> Path:
    home = base / "home"
    home.mkdir()
    os.chown(home, user.uid, user.gid)
    return home


def _as_user(user, script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`script` run by `user` (after exec, so the process is dumpable, as a login's are)."""
    return subprocess.Popen([PYTHON, "-c", script, *args], user=user.uid, group=user.gid, extra_groups=[],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/", env=env)


def _record(user, pid: int, out: Path, seconds: int, probes: str) -> subprocess.Popen:
    """`trainbpf record` as `sudo` runs it for `user`, in the background."""
    return subprocess.Popen([TRAINBPF, "record", "--pid", str(pid), "-d", str(seconds), "--gpu", "off",
                             "--probes", probes, "-o", str(out)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **user.sudo}, text=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_pid_1_is_refused_under_sudo(base, attacker):
    home = _home(base, attacker)
    res = cli("record", "--pid", "1", "-d", "1", "--gpu", "off", "--probes", "sched", "-o", str(home / "t.parquet"),
              env=attacker.sudo)
    one_line_error(res, TargetError.exit_code, "process 1", "uid 0", f"processes uid {attacker.uid} could ptrace")
    assert not list(home.iterdir())


# -- item 4: a traced process that execs a setuid program leaves ------------------------

EXECS = r"""
import os, sys, time
print("ready", flush=True)
sys.stdin.readline()
time.sleep(0.3)
print(time.monotonic_ns(), flush=True)
os.execve(sys.argv[1], ["sleep", "3"], {**os.environ, "RANK": "7"})
"""


@pytest.mark.parametrize("setuid", [True, False], ids=["setuid", "plain"])
def test_a_process_that_execs_a_setuid_program_leaves_the_trace(base, attacker, setuid):
    """The user's process execs a setuid-root copy of sleep: nothing of it from the exec
    on is in the trace (the 3 s sleep was, with its stacks), nor its environment.  A plain
    copy is traced on, its environment read again after the exec."""
    if os.statvfs(base).f_flag & os.ST_NOSUID:
        pytest.fail(f"{base} is on a nosuid file system: the setuid bit would not apply")
    program = base / "sleep-copy"
    shutil.copy("/bin/sleep", program)
    program.chmod(0o4755 if setuid else 0o755)
    home = _home(base, attacker)
    out = home / "t.parquet"
    proc = _as_user(attacker, EXECS, str(program), env={"PATH": os.environ["PATH"], "RANK": "3", "WORLD_SIZE": "8"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        rec = _record(attacker, proc.pid, out, 12, "sched,futex")
        wait_for(spool_path_for(out))
        time.sleep(1.5)  # the tree is seeded just after the spool is created
        proc.stdin.write("go\n")
        proc.stdin.flush()
        exec_ns = int(proc.stdout.readline())
        err = rec.communicate(timeout=120)[1]
    finally:
        _stop(proc)
    assert rec.returncode == 0, err
    trace = read_trace(out)
    offcpu = trace.frame("offcpu")
    slept = offcpu[(offcpu.pid == proc.pid) & (offcpu.ts_ns > exec_ns) & (offcpu.dur_ns > 1.5e9)]
    env = trace.view("process_env")
    env = env[env.pid == proc.pid]
    ranks = [dict(zip(read.variable, read.value)) for _, read in env.groupby("ts_ns")]
    # read as the user's process at the start; after the exec, only if it is still theirs
    assert ranks == [{"RANK": "3", "WORLD_SIZE": "8"}] + ([] if setuid else [{"RANK": "7", "WORLD_SIZE": "8"}]), ranks
    if not setuid:
        assert len(slept) == 1, "a plain exec was not traced on"
        assert not trace.meta.get("untraced"), trace.meta.get("untraced")
        return
    assert slept.empty, f"the setuid program's sleep is in the trace: {slept.to_dict('records')}"
    untraced = trace.meta.get("untraced") or []
    assert [(u["pid"], u["when"]) for u in untraced] == [(proc.pid, "exec of sleep-copy")], untraced
    assert "uid" in untraced[0]["why"] and f"process {proc.pid}" in err and "not traced" in err, err
    left_ns = untraced[0]["ts_ns"]
    # (stack rows carry the recording's end: they name the stacks of earlier rows)
    after = [(kind, len(rows)) for kind in ("thread", "offcpu", "offcpu_short", "futex", "exit")
             for rows in [trace.frame(kind)] if "pid" in rows
             for rows in [rows[(rows.pid == proc.pid) & (rows.ts_ns >= left_ns)]] if len(rows)]
    assert after == [("exit", 1)], f"rows of the process from its exec on: {after}"


# -- item 3: uprobes on the mapped file, not on the name --------------------------------

# In a user and mount namespace of its own (a rootless container's), the process maps its
# library, then mounts another file over the name: the name, in its root, now leads to
# that file; /proc/PID/maps still shows the name.
SWAPS = r"""
import ctypes, os, sys, time
lib_path, decoy = sys.argv[1], sys.argv[2]
lib = ctypes.CDLL(lib_path)
libc = ctypes.CDLL(None, use_errno=True)
if libc.mount(decoy.encode(), lib_path.encode(), None, 4096, None):  # MS_BIND
    raise SystemExit(f"mount: {os.strerror(ctypes.get_errno())}")
launch = ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value
print("ready", flush=True)
end = time.monotonic() + 25
while ctypes.string_at(launch, 1) != b"\xcc" and time.monotonic() < end:  # until probed
    time.sleep(0.05)
for _ in range(77):
    lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
print("probed" if ctypes.string_at(launch, 1) == b"\xcc" else "never probed", flush=True)
time.sleep(60)
"""

# A root process mapping the other library: a uprobe on that file shows in its memory.
MAPS_DECOY = r"""
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
print(ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value, flush=True)
time.sleep(60)
"""


def _fake_driver(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("fake_cuda_build", ROOT / "scripts" / "fake-cuda" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build(out)
    return out / mod.DRIVER


def test_uprobes_go_on_the_mapped_library_not_where_its_name_now_leads(base, attacker):
    """Was: root attached to the file the name led to at attach time, a root-owned
    library the user chose (1,355 rows of calls into it, uprobes in every process using it)."""
    require_root()
    driver = _fake_driver(base / "build")
    home = _home(base, attacker)
    (home / "fc").mkdir()
    mine = home / "fc" / "libcuda.so.1"
    shutil.copy(driver, mine)
    for path in (home / "fc", mine):
        os.chown(path, attacker.uid, attacker.gid)
    mapped = os.stat(mine)
    (base / "rootlib").mkdir(mode=0o755)
    decoy = base / "rootlib" / "libcuda.so.1"  # root's
    shutil.copy(driver, decoy)
    # The watcher maps it by a second name that is no CUDA library's: a node-wide recording
    # running beside this test probes every libcuda.so.1 any process maps.
    os.link(decoy, base / "rootlib" / "watched")
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", PYTHON, "-c", SWAPS, str(mine),
                             str(decoy)], user=attacker.uid, group=attacker.gid, extra_groups=[],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, cwd="/")
    watcher = subprocess.Popen([PYTHON, "-c", MAPS_DECOY, str(base / "rootlib" / "watched")], stdout=subprocess.PIPE,
                               text=True)
    out = home / "t.parquet"
    try:
        assert proc.stdout.readline().strip() == "ready"
        shown = [ln for ln in Path(f"/proc/{proc.pid}/maps").read_text().splitlines() if "libcuda" in ln]
        assert shown and all(ln.endswith(str(mine)) for ln in shown), shown
        decoy_launch = int(watcher.stdout.readline())
        rec = _record(attacker, proc.pid, out, 8, "cuda")
        decoy_probed = False
        with open(f"/proc/{watcher.pid}/mem", "rb") as mem:
            while rec.poll() is None:
                decoy_probed |= os.pread(mem.fileno(), 1, decoy_launch) == b"\xcc"
                time.sleep(0.02)
        err = rec.stderr.read()
        assert rec.returncode == 0, err
        said = proc.stdout.readline().strip()
    finally:
        _stop(proc, watcher)
    assert not decoy_probed, "root attached uprobes to the library the name was pointed at"
    libs = read_trace(out).meta["cuda"]["libraries"]
    assert [(lib["path"], lib["device"], lib["inode"]) for lib in libs] == [
        (str(mine), f"{os.major(mapped.st_dev):02x}:{os.minor(mapped.st_dev):02x}", mapped.st_ino)], libs
    assert "cuLaunchKernel" in libs[0]["symbols"] and not libs[0]["failed"]
    assert said == "probed", "the library the process mapped was not probed"
    launches = read_trace(out).frame("cuda_launch")
    assert int(launches.loc[launches.op == 0, "count"].sum()) == 77
    assert f"cuda: probing {len(libs[0]['symbols'])} symbols in {mine}" in err, err
