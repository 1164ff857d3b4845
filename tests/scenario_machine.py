"""The machine around a scenario run (tests/scenario_harness.py): the dirty-page limits a
run lowers and the memory cgroup it runs in (always restored or removed), how busy its cores are, a wait for it to quieten down
before a run, and the CPU time its neighbours (everything but the workload and the
recorder) used during one."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

VM_SYSCTL = Path("/proc/sys/vm")


class ScenarioError(RuntimeError):
    """The scenario could not be run to a report (as opposed to a wrong answer)."""


@contextlib.contextmanager
def lowered_dirty_limits(dirty_bytes: int, background_bytes: int):
    """Set vm.dirty_bytes and vm.dirty_background_bytes; restore all four dirty knobs
    after.  Setting a *_bytes knob zeroes its *_ratio twin (and back), so the one that
    was in force is written back."""
    knobs = ("dirty_bytes", "dirty_ratio", "dirty_background_bytes", "dirty_background_ratio")
    saved = {k: (VM_SYSCTL / k).read_text().strip() for k in knobs}
    try:
        (VM_SYSCTL / "dirty_background_bytes").write_text(str(background_bytes))
        (VM_SYSCTL / "dirty_bytes").write_text(str(dirty_bytes))
        yield
    finally:
        for in_bytes, as_ratio in (("dirty_bytes", "dirty_ratio"),
                                   ("dirty_background_bytes", "dirty_background_ratio")):
            knob = in_bytes if int(saved[in_bytes]) else as_ratio
            (VM_SYSCTL / knob).write_text(saved[knob])


# Other work on the machine competes with the workload for the two cores and turns any
# injected stall into CPU contention.  Wait (a while) for the machine to quieten down
# before a run, and say how busy it was when a result looks wrong.
QUIET_BELOW_CORES = 0.5
QUIET_WAIT_S = 20


def _cpu_ticks() -> tuple[int, int]:
    """(all, idle) CPU ticks of the machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]  # idle + iowait


def busy_cores(seconds: float = 1.0) -> float:
    """CPUs' worth of non-idle time on the machine over the next `seconds`."""
    total0, idle0 = _cpu_ticks()
    time.sleep(seconds)
    total1, idle1 = _cpu_ticks()
    if total1 <= total0:
        return 0.0
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process `pid`, its reaped children and its live
    descendants."""
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(child)
        used[child] = sum(int(x) for x in fields[11:15]) / ticks  # utime stime cutime cstime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += used.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


class NeighbourMeter:
    """CPU used on the machine between start() and stop() by everything except the
    workload's process tree and this process's children (the recorder and its
    nvidia-smi)."""

    def __init__(self, workload_pid: int):
        self.workload_pid = workload_pid

    def _sample(self) -> tuple[float, float, float, float]:
        total, idle = _cpu_ticks()
        own = os.times()
        return (time.monotonic(), (total - idle) / os.sysconf("SC_CLK_TCK"),
                _tree_cpu_s(self.workload_pid), own.children_user + own.children_system)

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> float:
        """Neighbours' CPUs' worth of time since start()."""
        end = self._sample()
        wall, busy, workload, recorder = (b - a for a, b in zip(self._start, end))
        return max(0.0, busy - workload - recorder) / wall if wall > 0 else 0.0


def wait_for_quiet(limit_cores: float = QUIET_BELOW_CORES, timeout: float = QUIET_WAIT_S) -> float:
    """Wait up to `timeout` for CPU use to drop below `limit_cores`; return the last
    measurement (the run goes ahead either way)."""
    deadline = time.monotonic() + timeout
    while True:
        load = busy_cores()
        if load < limit_cores or time.monotonic() > deadline:
            return load


@dataclass
class MemoryCgroup:
    path: Path
    parent: Path  # where left-over processes go before the cgroup is removed
    version: int

    def add_self(self) -> None:
        """Move the calling process in (used between fork and exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (self.parent / "cgroup.procs").write_text(pid)
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                # EBUSY while exiting tasks are still charged to it: retry briefly.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _memory_cgroup_location() -> tuple[Path, int]:
    """(this process's memory cgroup folder, cgroup version) from /proc/self."""
    v1_path = v2_path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1_path = path
        elif controllers == "":
            v2_path = path
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        root, mount_point = fields[3], fields[4]
        after = fields[fields.index("-") + 1:]
        fstype, super_options = after[0], after[2].split(",")
        if v1_path is not None and fstype == "cgroup" and "memory" in super_options:
            return Path(mount_point) / os.path.relpath(v1_path, root), 1
        if v1_path is None and v2_path is not None and fstype == "cgroup2":
            return Path(mount_point), 2
    raise ScenarioError("no memory cgroup controller is mounted")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh memory cgroup limited to `limit_bytes`, removed afterwards.

    cgroup v1 (the memory controller on its own hierarchy): a child of this process's
    memory cgroup, so the limits above still count.  cgroup v2: a child of the root (a
    v2 cgroup holding processes cannot delegate controllers to children)."""
    base, version = _memory_cgroup_location()
    name = f"trainbpf-test-{os.getpid()}-{secrets.token_hex(3)}"
    if version == 2:
        control = base / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            raise ScenarioError(f"the memory controller is not enabled in {control}")
    cgroup = MemoryCgroup(base / name, base, version)
    cgroup.path.mkdir()
    try:
        if version == 1:
            (cgroup.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (cgroup.path / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(FileNotFoundError):
                (cgroup.path / "memory.swap.max").write_text("0")
        yield cgroup
    finally:
        cgroup.remove()
