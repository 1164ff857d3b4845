"""A container made by hand for the real-kernel tests: new pid and mount namespaces
(unshare), a root file system of the host's /usr and /etc bound read-only plus another
CPython build bound at a path the host does not have, /proc mounted fresh for the new
pid namespace, pivot_root into it, and a cgroup whose path is a Kubernetes pod's container's.

Everything is undone on the way out, whatever happens: killing the namespace's first
process ends every process in it, the mounts go with the last of them, and the cgroups
made are removed.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shlex
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CGROUP_PIDS = Path("/sys/fs/cgroup/pids")  # a v1 hierarchy here; v2 puts the same path under /sys/fs/cgroup
CONTAINER_PYTHON = "/opt/py312"  # where the container's CPython lives (not on the host)
DATA = "/data"  # the test's folder, shared with the container
WORKLOADS = "/workloads"
READY_TIMEOUT_S = 60
OLD_ROOT = "/.old-root"  # where pivot_root puts the host's root, unmounted at once


class ContainerError(Exception):
    pass


@dataclass
class Container:
    init: subprocess.Popen  # unshare, whose child is the namespace's first process
    host_pid: int  # the workload's pid as the host sees it
    ns_pid: int  # ... and as it sees itself
    container_id: str
    pod_uid: str
    cgroup: str  # the cgroup's path below the hierarchy's root, as /proc/PID/cgroup shows it

    def data_path(self, host_path: Path, workdir: Path) -> str:
        """A file of the test's folder by its path inside the container."""
        return f"{DATA}/{host_path.relative_to(workdir)}"


def kubepods_cgroup(container_id: str, pod_uid: str) -> str:
    """A pod's container's cgroup under the systemd driver (kubelet's burstable class,
    containerd): how it looks on a node."""
    pod = pod_uid.replace("-", "_")  # systemd's slice names cannot hold '-' inside a unit part
    return (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod}.slice/"
            f"cri-containerd-{container_id}.scope")


@contextlib.contextmanager
def made_cgroup(path: str):
    """The pids cgroup `path`, made with whichever of its parents are missing; every
    folder made removed on exit (once its processes are gone)."""
    made = []
    at = CGROUP_PIDS
    for part in path.strip("/").split("/"):
        at = at / part
        if not at.exists():
            at.mkdir()
            made.append(at)
    try:
        yield at
    finally:
        for folder in reversed(made):
            for _ in range(100):  # the namespace's processes leave it a moment after the kill
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def _root_script(rootfs: Path, binds: list[tuple[str, str, str]], argv: list[str], env: dict[str, str]) -> str:
    """The shell run as the new pid namespace's first process: mounts (`binds`: host
    folder, folder in `rootfs`, ro or rw), then pivot_root into `rootfs` and the old
    root unmounted, as runtimes do (the host then sees the container's paths in its
    /proc/PID/maps, not the folders they came from)."""
    root = shlex.quote(str(rootfs))
    lines = ["set -e", "mount --make-rprivate /", f"mount --bind {root} {root}"]
    for src, dest, mode in binds:
        target = shlex.quote(str(rootfs / dest))
        lines.append(f"mount --bind {shlex.quote(src)} {target}")
        if mode == "ro":
            lines.append(f"mount -o remount,bind,ro {target}")
    lines += [f"mount --rbind /dev {shlex.quote(str(rootfs / 'dev'))}",
              f"mount -t proc proc {shlex.quote(str(rootfs / 'proc'))}",
              f"mount -t tmpfs tmpfs {shlex.quote(str(rootfs / 'tmp'))}"]
    variables = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    lines += [f"cd {root}", f"pivot_root . {OLD_ROOT[1:]}", "cd /", f"umount -l {OLD_ROOT}"]
    # Not exec: the workload is not the namespace's first process, as in most containers.
    lines.append(f"/usr/bin/env -i {variables} " + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines)


def _make_rootfs(rootfs: Path, binds: list[tuple[str, str, str]]) -> None:
    for name in ["dev", "proc", "tmp", OLD_ROOT[1:]] + [dest for _, dest, _ in binds]:
        (rootfs / name).mkdir(parents=True, exist_ok=True)
    for name in ("bin", "lib", "lib64", "sbin"):  # merged /usr: the same links inside
        host = Path("/") / name
        if host.is_symlink():
            (rootfs / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            raise ContainerError(f"/{name} is not a link into /usr: this set-up binds only /usr")


def _ns_pid(host_pid: int) -> list[int]:
    """A process's pids, the host's first, from the NSpid line of /proc/PID/status."""
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return [host_pid]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        at = todo.pop()
        try:
            kids = Path(f"/proc/{at}/task/{at}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _host_pid_of(init_pid: int, ns_pid: int) -> int:
    for pid in _descendants(init_pid):
        with contextlib.suppress(OSError):
            pids = _ns_pid(pid)
            if len(pids) > 1 and pids[-1] == ns_pid:
                return pid
    raise ContainerError(f"no process with pid {ns_pid} in the new pid namespace")


def _ready_line(proc: subprocess.Popen) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(READY_TIMEOUT_S):
            return f"(no line within {READY_TIMEOUT_S} s)"
    return proc.stdout.readline().decode(errors="replace").strip()


@contextlib.contextmanager
def container(workdir: Path, python_home: Path, workloads: Path, argv: list[str], env: dict[str, str],
              extra: dict[str, Path] | None = None, nice: int = 0):
    """Run `argv` (paths as the container sees them: CONTAINER_PYTHON, WORKLOADS, DATA =
    `workdir`, and `extra`'s: path inside -> host folder, bound read-only) in a
    container, its session's scheduling group at `nice` (the kernel's autogroups weigh
    sessions, not tasks, against each other); yield the Container once it printed
    `ready pid=N`."""
    container_id, pod_uid = os.urandom(32).hex(), str(uuid.uuid4())
    cgroup = kubepods_cgroup(container_id, pod_uid)
    rootfs = workdir / "rootfs"
    binds = [("/usr", "usr", "ro"), ("/etc", "etc", "ro"), (str(python_home), CONTAINER_PYTHON[1:], "ro"),
             (str(workloads), WORKLOADS[1:], "ro"), (str(workdir), DATA[1:], "rw")]
    binds += [(str(host), inside.strip("/"), "ro") for inside, host in (extra or {}).items()]
    _make_rootfs(rootfs, binds)
    script = _root_script(rootfs, binds, argv, env)
    log = open(workdir / "container.log", "wb")
    with made_cgroup(cgroup) as folder:
        procs = folder / "cgroup.procs"
        def enter() -> None:  # in the child, before unshare runs
            procs.write_text(str(os.getpid()))
            os.setsid()
            with contextlib.suppress(OSError):  # no autogroups: nice alone
                Path("/proc/self/autogroup").write_text(str(nice))

        init = subprocess.Popen(["nice", "-n", str(nice), "unshare", "--pid", "--mount", "--fork", "--kill-child", "sh", "-c", script],
                                stdout=subprocess.PIPE, stderr=log,
                                preexec_fn=enter)
        try:
            line = _ready_line(init)
            if not line.startswith("ready pid="):
                raise ContainerError(f"the container's workload did not start: {line!r}; "
                                     f"{(workdir / 'container.log').read_text(errors='replace')[-2000:]}")
            ns_pid = int(line.split("=", 1)[1])
            yield Container(init, _host_pid_of(init.pid, ns_pid), ns_pid, container_id, pod_uid, cgroup)
        finally:
            init.send_signal(signal.SIGKILL)  # --kill-child: the namespace's first process dies, then all in it
            init.wait()
            log.close()
