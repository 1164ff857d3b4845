"""Where the bytes copied to a GPU come from: the NUMA node of each host->device copy's
source page, asked of the kernel with a query-only move_pages(2) (nodes NULL: the
status array gets each page's node and nothing is moved), and each traced thread's CPU
affinity and allowed memory nodes (/proc/PID/task/TID/status).

The queries are rate-limited (settings below): at most PAGES_PER_S pages a second, each
distinct page at most once a second (a copy from a page asked about within the second
takes that answer), only while the process lives."""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import platform
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from trainbpf.trace.spool import make_batch

PAGES_PER_S = 300  # move_pages queries a second, all processes together
PAGE_TTL_NS = 1_000_000_000  # a page's answer stands this long
POLICY_TTL_NS = 1_000_000_000  # a process's numa_maps is read again after this
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MOVE_PAGES_NR = {"x86_64": 279, "aarch64": 239, "ppc64le": 301, "s390x": 310}
# What a copy's source turned out to be: host memory on a node, not host memory (a
# device pointer: the kernel answers -EFAULT or -ENOENT), or not asked (rate limit, the
# process gone).
HOST, NOT_HOST, UNKNOWN = "host", "not_host", "unknown"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def query_page_nodes(pid: int, addrs: list[int]) -> list[int]:
    """Each page's node (>= 0) or its -errno (-EFAULT, -ENOENT: not mapped or not
    present), from move_pages(pid, n, pages, nodes=NULL, status, 0): with nodes NULL the
    kernel only reports where the pages are.  OSError when the call fails as a whole
    (ESRCH: the process is gone; EPERM)."""
    nr = MOVE_PAGES_NR.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"move_pages: unknown syscall number on {platform.machine()}")
    count = len(addrs)
    pages = (ctypes.c_void_p * count)(*[a & ~(PAGE_SIZE - 1) for a in addrs])
    status = (ctypes.c_int * count)(*([-errno.ENOENT] * count))
    nodes = None  # never a target array: nothing moves
    # every argument a full register wide: syscall(2) passes them on as longs
    if _libc.syscall(ctypes.c_long(nr), ctypes.c_long(pid), ctypes.c_ulong(count), pages, nodes, status,
                     ctypes.c_long(0)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"move_pages({pid}): {os.strerror(err)}")
    return list(status)


def numa_policies(text: str) -> list[tuple[int, str]]:
    """(start address, policy) of each mapping of a /proc/PID/numa_maps, by address."""
    out = []
    for line in text.splitlines():
        start, _, rest = line.partition(" ")
        try:
            out.append((int(start, 16), rest.split(" ", 1)[0]))
        except ValueError:
            continue
    return sorted(out)


def policy_at(policies: list[tuple[int, str]], addr: int) -> str:
    """The policy of the mapping starting at or below `addr` ("" when none)."""
    i = bisect.bisect_right(policies, (addr, "\U0010ffff")) - 1
    return policies[i][1] if i >= 0 else ""


class PageNodes:
    """Rate-limited, cached source-page lookups for one recording."""

    def __init__(self, *, pages_per_s: int = PAGES_PER_S, clock: Callable[[], int] = time.monotonic_ns,
                 query: Callable[[int, list[int]], list[int]] = query_page_nodes):
        self.pages_per_s, self.clock, self.query = pages_per_s, clock, query
        self.answers: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, page) -> (asked ns, status)
        self.policies: dict[int, tuple[int, list[tuple[int, str]]]] = {}  # pid -> (read ns, policies)
        self.window_ns, self.asked = 0, 0
        self.gone: set[int] = set()  # processes move_pages found gone
        self.queries = 0

    def node(self, pid: int, addr: int) -> int | None:
        """The node of `addr`'s page in `pid` (>= 0), -errno when it is not host memory,
        None when not asked (rate limit, process gone).  Once the process is gone (its
        last copies are read after it exited), a page's last answer, however old, stands."""
        now, page = self.clock(), addr & ~(PAGE_SIZE - 1)
        known = self.answers.get((pid, page))
        if known is not None and (now - known[0] < PAGE_TTL_NS or pid in self.gone):
            return known[1]
        if pid in self.gone:
            return None
        if now - self.window_ns >= 1_000_000_000:  # a new second: answers past their time go
            self.window_ns, self.asked = now, 0
            self.answers = {k: v for k, v in self.answers.items() if now - v[0] < PAGE_TTL_NS or k[0] in self.gone}
        if self.asked >= self.pages_per_s:
            return None
        self.asked += 1
        self.queries += 1
        try:
            status = self.query(pid, [page])[0]
        except OSError:
            self.gone.add(pid)
            if known is None:
                return None
            self.answers[(pid, page)] = known
            return known[1]
        self.answers[(pid, page)] = (now, status)
        return status

    def policy(self, pid: int, addr: int) -> str:
        """The memory policy of the mapping holding `addr` ("default", "bind:1", ...)."""
        now = self.clock()
        read = self.policies.get(pid)
        if read is None or now - read[0] >= POLICY_TTL_NS:
            try:
                text = Path(f"/proc/{pid}/numa_maps").read_text()
            except OSError:
                text = ""
            read = self.policies[pid] = (now, numa_policies(text))
        return policy_at(read[1], addr)

    def copy_rows(self, ts, tid, pid, src, nbytes) -> pa.RecordBatch | None:
        """copy_node rows for copies (equal-length sequences) with a source pointer."""
        rows = []
        for t, th, p, s, n in zip(ts, tid, pid, src, nbytes):
            status = self.node(p, s)
            state = UNKNOWN if status is None else (HOST if status >= 0 else NOT_HOST)
            rows.append((t, th, p, s, n, status if state == HOST else -1,
                         state, self.policy(p, s) if state == HOST else ""))
        if not rows:
            return None
        ts, tid, pid, src, nbytes, node, state, policy = zip(*rows)
        return make_batch("copy_node", {
            "ts_ns": np.array(ts, np.int64), "tid": np.array(tid, np.int32), "pid": np.array(pid, np.int32),
            "src": np.array(src, np.uint64), "bytes": np.array(nbytes, np.int64), "node": np.array(node, np.int32),
            "source": list(state), "policy": list(policy)})


STATUS_LIST = re.compile(r"^(Cpus_allowed_list|Mems_allowed_list):\s*(\S*)$", re.M)


def thread_affinity(pid: int, tid: int, proc: Path = Path("/proc")) -> tuple[str, str] | None:
    """(Cpus_allowed_list, Mems_allowed_list) of a thread, None when it is gone."""
    try:
        text = (proc / str(pid) / "task" / str(tid) / "status").read_text()
    except OSError:
        return None
    found = dict(STATUS_LIST.findall(text))
    return found.get("Cpus_allowed_list", ""), found.get("Mems_allowed_list", "")


class Affinities:
    """Each traced thread's affinity, read once when it is first seen."""

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc
        self.seen: set[int] = set()

    def take(self, live: dict[int, int]) -> pa.RecordBatch | None:
        rows = []
        for tid, pid in live.items():
            if tid in self.seen:
                continue
            self.seen.add(tid)
            found = thread_affinity(pid, tid, self.proc)
            if found is not None:
                rows.append((time.monotonic_ns(), tid, pid, *found))
        if not rows:
            return None
        ts, tid, pid, cpus, mems = zip(*rows)
        return make_batch("affinity", {"ts_ns": np.array(ts, np.int64), "tid": np.array(tid, np.int32),
                                       "pid": np.array(pid, np.int32), "cpus": list(cpus), "mems": list(mems)})
