"""Which container each traced process runs in, from its cgroup path (/proc/PID/cgroup,
read from the host's side: the full path, whatever cgroup namespace the process has):
`container` rows (docs/trace-format.md; docs/security.md, "What a trace contains").

Container runtimes name a container's cgroup after its id, and kubelet names a pod's
after its UID:

    docker (systemd driver)   /system.slice/docker-<id>.scope
    docker (cgroupfs driver)  /docker/<id>
    containerd, cri-o         .../cri-containerd-<id>.scope, .../crio-<id>.scope
    podman                    /machine.slice/libpod-<id>.scope, /libpod_parent/libpod-<id>
    kubelet (systemd driver)  /kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/...
    kubelet (cgroupfs driver) /kubepods/<qos>/pod<uid>/<id>

The pod's Kubernetes namespace and name appear in none of these layouts: they are not
recorded (the pod UID leads to them through the API server).  Under kubelet's cgroupfs
driver the container's folder is its bare id, which does not say which runtime made it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from trainbpf.trace.printable import printable
from trainbpf.trace.spool import make_batch
from trainbpf.tracer.collector import ThreadTable

CGROUP_READ_BYTES = 1 << 16
# <runtime's prefix>-<id>[.scope]; a conmon's scope (libpod-conmon-<id>, crio-conmon-<id>)
# is the monitor's, not the container's, and does not match.
_RUNTIME_UNIT = re.compile(r"^(docker|cri-containerd|crio|libpod)-([0-9a-f]{64})(?:\.scope)?$")
RUNTIMES = {"docker": "docker", "cri-containerd": "containerd", "crio": "cri-o", "libpod": "podman"}
_BARE_ID = re.compile(r"^[0-9a-f]{64}$")
# kubepods-pod<uid>.slice, kubepods-burstable-pod<uid>.slice (systemd: '-' in the UID as '_')
_POD_SLICE = re.compile(r"^kubepods(?:-besteffort|-burstable)?-pod([0-9a-f_]{36})\.slice$")
_POD_FOLDER = re.compile(r"^pod([0-9a-f-]{36})$")  # cgroupfs: /kubepods[/<qos>]/pod<uid>
# Fields of a `container` row, in the order they are written.
FIELDS = ("id", "runtime", "pod_uid", "cgroup")


@dataclass(frozen=True)
class ContainerIdentity:
    id: str  # the runtime's container id (64 hex digits)
    runtime: str | None  # docker, containerd, cri-o, podman; None where the path does not say
    pod_uid: str | None  # the Kubernetes pod's UID, where the path shows one
    cgroup: str  # the cgroup path it was read from

    def fields(self) -> dict[str, str]:
        """FIELDS that are known, as the trace's rows hold them."""
        values = (self.id, self.runtime, self.pod_uid, printable(self.cgroup))  # a path: any bytes
        return {k: v for k, v in zip(FIELDS, values) if v}


def identify(path: str) -> ContainerIdentity | None:
    """The container a cgroup path names, None when it names none.  The innermost
    container wins (one nested in another, or a container's own systemd units below it)."""
    parts = [p for p in path.split("/") if p]
    found: tuple[str, str | None] | None = None
    pod = None
    for i, part in enumerate(parts):
        unit = _RUNTIME_UNIT.match(part)
        pod_match = _POD_SLICE.match(part) or _POD_FOLDER.match(part)
        if unit:
            found = (unit.group(2), RUNTIMES[unit.group(1)])
        elif pod_match:
            pod = pod_match.group(1).replace("_", "-")
        elif _BARE_ID.match(part) and i > 0 and (parts[i - 1] == "docker" or _POD_FOLDER.match(parts[i - 1])):
            found = (part, "docker" if parts[i - 1] == "docker" else None)
    if found is None:
        return None
    return ContainerIdentity(found[0], found[1], pod, path)


def from_cgroup_file(text: str) -> ContainerIdentity | None:
    """The container of a /proc/PID/cgroup text: the v2 line (0::PATH) first, then the
    v1 hierarchies' lines (ID:CONTROLLERS:PATH) in their order; the first path that
    names one."""
    entries = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    entries.sort(key=lambda e: e[0] != "0")
    for _, _, path in entries:
        found = identify(path)
        if found is not None:
            return found
    return None


def read_identity(pid: int) -> ContainerIdentity | None:
    """Process `pid`'s container; None when it runs in none or is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as fh:
            return from_cgroup_file(fh.read(CGROUP_READ_BYTES).decode("utf-8", "surrogateescape"))
    except OSError:
        return None


class ContainerReader:
    """`container` rows of the traced processes, each read once when it joins (a
    process's cgroup is its container's from its start; moving it to another is rare)."""

    def __init__(self):
        self.found: dict[int, ContainerIdentity] = {}
        self._tids_seen = 0  # ThreadTable.tgid entries already looked at (it only grows)
        self._read: set[int] = set()

    def take(self, threads: ThreadTable) -> pa.RecordBatch | None:
        pending = set(list(threads.tgid.values())[self._tids_seen:]) - self._read - threads.untraced
        self._tids_seen = len(threads.tgid)
        rows: list[tuple[int, int, str, str]] = []
        for pid in sorted(pending):
            self._read.add(pid)
            found = read_identity(pid)
            if found is None:
                continue
            self.found[pid] = found
            now = time.monotonic_ns()
            rows += [(now, pid, name, value) for name, value in found.fields().items()]
        if not rows:
            return None
        ts, pids, names, values = zip(*rows)
        return make_batch("container", {"ts_ns": np.array(ts, dtype=np.int64), "pid": np.array(pids, dtype=np.int32),
                                        "field": list(names), "value": list(values)})
