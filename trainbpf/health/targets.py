"""Which processes the health check grades, and which tree it records: the given pids,
else the processes holding a GPU device file open or whose command line matches a
launcher pattern.  /proc is read through trainbpf.tracer.proctree."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from trainbpf.trace.errors import TargetError, UsageError
from trainbpf.tracer import proctree


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    comm: str
    cmdline: str  # argv joined by spaces; "" for kernel threads
    holds_device: bool = False


@dataclass(frozen=True)
class Target:
    pid: int
    comm: str
    cmdline: str
    reason: str  # "pid" (given), "device" (holds a device file), "pattern" (command matched)


# Device files a device_glob may name: a GPU node has a few dozen; a pattern that names
# more (say /proc/*/fd/*) is not a list of devices.
MAX_DEVICE_FILES = 4096


def device_files(device_glob: str) -> set[str]:
    """The resolved paths `device_glob` names; one that cannot be resolved (gone, or not
    readable, like another process's /proc/PID/fd/N) is left out."""
    devices = set()
    for i, path in enumerate(glob.iglob(device_glob)):
        if i >= MAX_DEVICE_FILES:
            raise UsageError(f"device_glob {device_glob!r} names more than {MAX_DEVICE_FILES} files; "
                             "name the GPU device files (default /dev/nvidia*)")
        try:
            devices.add(os.path.realpath(path, strict=True))
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop (strict=True says ELOOP since 3.13)
            continue
    return devices


def scan_processes(*, device_glob: str) -> dict[int, Process]:
    """Every live process: parent, name, command line, and whether it holds a file that
    `device_glob` names open (a GPU: /dev/nvidia0, /dev/nvidiactl, ...)."""
    devices = device_files(device_glob)
    out: dict[int, Process] = {}
    for pid, main in proctree.processes().items():
        if main.state in ("Z", "X"):
            continue
        out[pid] = Process(pid, main.parent_tid, main.comm, " ".join(proctree.cmdline(pid)),
                           bool(devices) and proctree.holds_open(pid, devices))
    return out


def ancestry(processes: Mapping[int, Process], pid: int) -> list[int]:
    """`pid`, its parent, ... up to the first process not in `processes`."""
    chain: list[int] = []
    while pid in processes and pid not in chain:
        chain.append(pid)
        pid = processes[pid].ppid
    return chain


def _target(p: Process, reason: str) -> Target:
    return Target(p.pid, p.comm, p.cmdline, reason)


def choose_targets(processes: Mapping[int, Process], *, command_patterns: tuple[str, ...],
                   exclude_patterns: tuple[str, ...], skip: set[int]) -> list[Target]:
    """The training processes among `processes`.

    Device holders come first; a forked child (a DataLoader worker) inherits its parent's
    device files, so only the topmost holder of a tree counts.  A command-pattern match
    counts when no device holder lies in its tree (a launcher is represented by the
    ranks it started) and no other match is above it."""
    include = [re.compile(p) for p in command_patterns]
    exclude = [re.compile(p) for p in exclude_patterns]

    def eligible(p: Process) -> bool:
        return p.pid not in skip and bool(p.cmdline) and not any(rx.search(p.cmdline) for rx in exclude)

    candidates = [p for p in processes.values() if eligible(p)]
    holders = {p.pid for p in candidates if p.holds_device}
    matched = {p.pid for p in candidates if p.pid not in holders and any(rx.search(p.cmdline) for rx in include)}
    above = {pid: set(ancestry(processes, pid)[1:]) for pid in holders | matched}
    ranks = {pid for pid in holders if not above[pid] & holders}
    under_rank = {a for r in ranks for a in above[r]}
    launchers = {pid for pid in matched if not above[pid] & (matched | holders) and pid not in under_rank}
    return [_target(processes[pid], "device") for pid in sorted(ranks)] + \
        [_target(processes[pid], "pattern") for pid in sorted(launchers)]


def given_targets(processes: Mapping[int, Process], pids: tuple[int, ...]) -> list[Target]:
    missing = [p for p in pids if p not in processes]
    if missing:
        raise TargetError(f"no such process: {', '.join(map(str, missing))} (--pid takes a process id, the kernel's tgid)")
    return [_target(processes[p], "pid") for p in dict.fromkeys(pids)]


def find_targets(processes: Mapping[int, Process], *, pids: tuple[int, ...], command_patterns: tuple[str, ...],
                 exclude_patterns: tuple[str, ...]) -> list[Target]:
    """The given `pids`, else the training processes found, never this process or its
    parents."""
    if pids:
        return given_targets(processes, pids)
    mine = set(ancestry(processes, os.getpid())) | {os.getpid()}
    return choose_targets(processes, command_patterns=command_patterns, exclude_patterns=exclude_patterns, skip=mine)


def recording_root(processes: Mapping[int, Process], pids: list[int]) -> int | None:
    """The deepest process whose tree holds every pid; None (trace the whole machine)
    when there is none below init."""
    if not pids:
        return None
    chains = [ancestry(processes, p) for p in pids]
    common = set(chains[0]).intersection(*map(set, chains[1:]))
    root = next((p for p in chains[0] if p in common), None)
    return root if root is not None and root > 1 else None


def tree_pids(processes: Mapping[int, Process], pid: int) -> set[int]:
    """`pid` and its descendant processes."""
    kids: dict[int, list[int]] = {}
    for p in processes.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(kids.get(p, []))
    return out


def target_trees(processes: Mapping[int, Process], targets: list[Target]) -> dict[int, tuple[set[int], set[int]]]:
    """Each target's tree when it was chosen: (process ids, their thread ids)."""
    trees = {}
    for t in targets:
        pids = tree_pids(processes, t.pid)
        trees[t.pid] = (pids, {th.tid for p in pids for th in proctree.threads_of(p)})
    return trees


def tree_tids(threads: pd.DataFrame, *, pids: set[int], tids: set[int]) -> set[int]:
    """`tids` plus every thread the trace saw start in one of the processes `pids`, or in
    a process that one of those threads created (trace "thread" rows)."""
    pids, tids = set(pids), set(tids)
    for row in threads.sort_values("ts_ns", kind="stable").itertuples(index=False):
        if row.name == "process" and not pd.isna(row.peer_tid) and int(row.peer_tid) in tids:
            pids.add(int(row.pid))
        if not pd.isna(row.pid) and int(row.pid) in pids:
            tids.add(int(row.tid))
    return tids
