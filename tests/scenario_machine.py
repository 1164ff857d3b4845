"""The machine around a scenario run (tests/scenario_harness.py): the dirty-page limits a
run lowers (always restored), how busy its cores are, a wait for it to quieten down
before a run, and the CPU time its neighbours (everything but the workload and the
recorder) used during one."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

VM_SYSCTL = Path("/proc/sys/vm")


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
