"""Samplers and facts from /proc and /sys: vmstat and PSI deltas, numa_maps per node,
CPU/NUMA/GPU topology, and the kernel's HZ."""

from __future__ import annotations

import gzip
import os
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from trainbpf.trace.documents import load_json
from trainbpf.trace.errors import UsageError
from trainbpf.trace.safefile import read_small
from trainbpf.trace.spool import make_batch

# The vmstat counters that speak to stalls: faults, reclaim, compaction, NUMA, dirty state.
VMSTAT_PREFIXES = (
    "pgfault", "pgmajfault", "pgscan", "pgsteal", "allocstall", "compact_", "numa_",
    "pgmigrate", "nr_dirty", "nr_writeback", "thp_", "workingset_", "pgpgin", "pgpgout",
    "pswp", "oom_kill",
)
GAUGES = ("nr_dirty", "nr_writeback", "nr_dirty_threshold", "nr_dirty_background_threshold")


VMSTAT_LINE = re.compile(rb"^((?:%s)\S*) (-?\d+)$" % b"|".join(re.escape(p.encode()) for p in VMSTAT_PREFIXES), re.M)
PSI_RESOURCES = ("cpu", "memory", "io")
PSI_LINE = re.compile(rb"^(\w+) .*total=(\d+)$", re.M)


def parse_vmstat(text: bytes) -> dict[str, int]:
    return {key.decode(): int(val) for key, val in VMSTAT_LINE.findall(text)}


def parse_psi(resource: str, text: bytes) -> dict[str, int]:
    """`resource.some|full` -> total stalled microseconds (cumulative)."""
    return {f"{resource}.{kind.decode()}": int(total) for kind, total in PSI_LINE.findall(text)}


class ProcSampler:
    """vmstat and PSI, as deltas since the previous sample (gauges as values), every
    `interval_ns` and at the stop.  The analysis sums them over the recording
    (analyzers/timeline/node.py), so a sample a second would only cost more: each costs ~0.2 ms
    of CPU with the caches cold.  The files stay open and are re-read from offset 0 (a
    /proc file is generated afresh on each read from the start), which halves that."""

    def __init__(self, *, interval_ns: int = 0, proc: Path = Path("/proc")) -> None:
        self.interval_ns = interval_ns
        self._fds: dict[str, int] = {}
        for name in ("vmstat", *(f"pressure/{r}" for r in PSI_RESOURCES)):
            try:
                self._fds[name] = os.open(proc / name, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
        self._t = time.monotonic_ns()
        self._vm, self._psi = self._read()

    def _read(self) -> tuple[dict[str, int], dict[str, int]]:
        vm: dict[str, int] = {}
        psi: dict[str, int] = {}
        for name, fd in self._fds.items():
            try:
                text = os.pread(fd, 1 << 16, 0)
            except OSError:
                continue
            if name == "vmstat":
                vm = parse_vmstat(text)
            else:
                psi.update(parse_psi(name.rpartition("/")[2], text))
        return vm, psi

    def take(self, *, final: bool = False) -> list[pa.RecordBatch]:
        now = time.monotonic_ns()
        if not final and now - self._t < self.interval_ns:
            return []
        vm, psi = self._read()
        # A file that could not be read keeps its last values (deltas of zero), so no
        # later delta counts from zero.
        vm, psi = vm or self._vm, {**self._psi, **psi}
        dur = now - self._t
        vm_rows = {k: (v if k in GAUGES else v - self._vm.get(k, 0)) for k, v in vm.items()}
        vm_rows = {k: v for k, v in vm_rows.items() if v or k in GAUGES}
        psi_rows = {k: v - self._psi.get(k, 0) for k, v in psi.items()}
        self._t, self._vm, self._psi = now, vm, psi
        out = []
        for kind, rows, key, delta in (("vmstat", vm_rows, "key", "delta"), ("psi", psi_rows, "resource", "stalled_us")):
            if rows:
                out.append(make_batch(kind, {
                    "ts_ns": np.full(len(rows), now, dtype=np.int64),
                    "dur_ns": np.full(len(rows), dur, dtype=np.int64),
                    key: list(rows), delta: np.array(list(rows.values()), dtype=np.int64),
                }))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def numa_maps_pages(pid: int) -> dict[int, int]:
    """Pages of process `pid` per NUMA node, from /proc/PID/numa_maps."""
    pages: dict[int, int] = {}
    try:
        text = Path(f"/proc/{pid}/numa_maps").read_text()
    except OSError:
        return pages
    for node, n in re.findall(r"\bN(\d+)=(\d+)", text):
        pages[int(node)] = pages.get(int(node), 0) + int(n)
    return pages


def numa_maps_batch(pids: list[int], phase: str) -> pa.RecordBatch | None:
    rows = [(p, node, n) for p in pids for node, n in numa_maps_pages(p).items()]
    if not rows:
        return None
    now = time.monotonic_ns()
    return make_batch("numa_maps", {
        "ts_ns": np.full(len(rows), now, dtype=np.int64),
        "pid": np.array([r[0] for r in rows], dtype=np.int32),
        "state": [phase] * len(rows),
        "node": np.array([r[1] for r in rows], dtype=np.int32),
        "pages": np.array([r[2] for r in rows], dtype=np.int64),
    })


def parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> dict[str, list[int]]:
    nodes = {}
    for d in sorted(root.glob("node[0-9]*")):
        try:
            nodes[d.name[4:]] = parse_cpulist((d / "cpulist").read_text())
        except OSError:
            continue
    return nodes


PCI_DEVICES = Path("/sys/bus/pci/devices")


def pci_numa_node(bus_id: str, devices: Path = PCI_DEVICES) -> int | None:
    """NUMA node of a PCI device given NVML's or nvidia-smi's bus id (00000000:19:00.0):
    sysfs names it with a 4-digit domain in lower case; -1 there means no node."""
    dom, _, rest = bus_id.strip().lower().partition(":")
    try:
        node = int((devices / f"{dom[-4:]:0>4}:{rest}" / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def declared_topology(path: Path) -> dict:
    """The nodes and GPUs of a declared topology file (`--topology`), read as the user
    who named it: a small regular file, never waited on (safefile.read_small)."""
    try:
        spec = load_json(read_small(path, f"--topology {path}"))  # TooDeep is a ValueError
        nodes = {str(k): [int(c) for c in v] for k, v in spec["nodes"].items()}
        gpu_list = [{"index": int(g["index"]), "node": g.get("node"), "bus_id": g.get("bus_id")}
                    for g in spec.get("gpus", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"--topology {path}: expected JSON "
                         '{"nodes": {"0": [cpus]}, "gpus": [{"index": 0, "node": 0}]} '
                         f"({exc.__class__.__name__})") from exc
    return {"nodes": nodes, "gpus": gpu_list}


def device_gpus(gpus: list[dict], devices: Path = PCI_DEVICES) -> list[dict]:
    """Each GPU's node from the device: NVML's where it said one, else its PCI device's."""
    return [{"index": g["index"], "bus_id": g["bus_id"],
             "node": g["node"] if g.get("node") is not None else pci_numa_node(g["bus_id"] or "", devices)}
            for g in gpus]


def topology(gpus: list[dict], declared: dict | None, devices: Path = PCI_DEVICES) -> dict:
    """CPUs per node and each GPU's node from the device (device_gpus); a declared
    topology (declared_topology) overrides the nodes, and the node of each GPU it
    gives one; GPUs it names without a node keep the device's."""
    gpu_list = device_gpus(gpus, devices)
    nodes = numa_nodes() if declared is None else declared["nodes"]
    if declared is not None:
        by_index = {g["index"]: g for g in gpu_list}
        for g in declared["gpus"]:
            found = by_index.setdefault(g["index"], {"index": g["index"], "bus_id": g.get("bus_id"), "node": None})
            if g.get("node") is not None:
                found["node"] = g["node"]
        gpu_list = [by_index[i] for i in sorted(by_index)]
    gpu_nodes = {g["node"] for g in gpu_list if g.get("node") is not None}
    return {
        "nodes": nodes,
        "gpus": gpu_list,
        "gpu_node": gpu_nodes.pop() if len(gpu_nodes) == 1 else None,
        "declared": declared is not None,
    }


THP_SETTINGS = ("enabled", "defrag")


def thp_mode(root: Path = Path("/sys/kernel/mm/transparent_hugepage")) -> dict[str, str | None]:
    """The transparent huge page settings, each the bracketed choice of its file
    ("always [madvise] never" -> "madvise"); None where the file is missing."""
    out: dict[str, str | None] = {}
    for name in THP_SETTINGS:
        try:
            text = (root / name).read_text()
        except OSError:
            out[name] = None
            continue
        chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()
        out[name] = chosen or None
    return out


def kernel_hz() -> int:
    """CONFIG_HZ: from the kernel config when readable, else measured from jiffies."""
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{_release()}")):
        try:
            raw = path.read_bytes()
            text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
        except OSError:
            continue
        m = re.search(r"^CONFIG_HZ=(\d+)$", text, re.M)
        if m:
            return int(m.group(1))
    return _measure_hz()


def _release() -> str:
    import platform

    return platform.release()


def _jiffies() -> int:
    text = Path("/proc/timer_list").read_text()
    return max(int(x) for x in re.findall(r"jiffies\s*:\s*(\d+)", text))


def _measure_hz() -> int:
    try:
        t0, j0 = time.monotonic(), _jiffies()
        time.sleep(0.2)
        t1, j1 = time.monotonic(), _jiffies()
    except (OSError, ValueError):
        return 250
    rate = (j1 - j0) / (t1 - t0)
    return min((100, 250, 300, 1000), key=lambda hz: abs(hz - rate))
