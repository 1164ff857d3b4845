"""The pieces of "NUMA from where the bytes are" without a recording: the query-only
move_pages wrapper on this process's own pages, the rate limit, the GPU's node from its
PCI device in a stand-in sysfs and the declared topology as an override, the numa_maps
policy lookup, and the remote share through the analysis into the health series."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest

from synth import TRAINER, t
from test_health_cuda import _assess, cuda_trainer
from test_health_outputs import parse_exposition
from trainbpf.analyzers.causes.numa import allowed_cpus
from trainbpf.health.outputs import render_textfile
from trainbpf.tracer.samplers import procfs
from trainbpf.tracer.samplers.pagenodes import (
    HOST, NOT_HOST, PAGE_SIZE, UNKNOWN, PageNodes, numa_policies, policy_at, query_page_nodes, thread_affinity,
)


def _own_pages(n: int) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(-1, n * PAGE_SIZE)
    buf.write(b"\x01" * (n * PAGE_SIZE))
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_query_gives_the_node_of_present_pages_and_errors_for_others():
    buf, addr = _own_pages(2)
    untouched = mmap.mmap(-1, PAGE_SIZE)
    far = ctypes.addressof(ctypes.c_char.from_buffer(untouched))
    got = query_page_nodes(os.getpid(), [addr + 5, addr + PAGE_SIZE, far, 0x10])
    assert got[:2] == [0, 0], got  # this machine's one node
    assert got[2] == -errno.ENOENT and got[3] in (-errno.EFAULT, -errno.ENOENT), got
    del untouched, buf


def test_query_of_a_process_that_is_gone_raises():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(OSError) as err:
        query_page_nodes(pid, [0x1000])
    assert err.value.errno == errno.ESRCH


def test_lookups_are_cached_a_second_and_limited_per_second():
    now = [0]
    asked: list[int] = []

    def query(pid: int, addrs: list[int]) -> list[int]:
        asked.extend(addrs)
        return [0 if a < 0x100000 else -errno.EFAULT for a in addrs]

    pages = PageNodes(pages_per_s=3, clock=lambda: now[0], query=query)
    assert pages.node(1, 0x1010) == 0 and pages.node(1, 0x1ff0) == 0  # one page, asked once
    assert asked == [0x1000]
    assert pages.node(1, 0x200000) == -errno.EFAULT
    assert pages.node(1, 0x3000) == 0
    assert pages.node(1, 0x4000) is None  # the fourth page in the second
    now[0] = 1_000_000_000
    assert pages.node(1, 0x4000) == 0 and pages.node(1, 0x1000) == 0  # the answer of a second ago is asked again
    assert asked == [0x1000, 0x200000, 0x3000, 0x4000, 0x1000]


def test_a_process_gone_keeps_its_pages_last_answers():
    """The last copies of a process are read after it exited: what its pages answered
    before stands; a page never asked about is unknown."""
    now, alive = [0], [True]

    def query(pid: int, addrs: list[int]) -> list[int]:
        if not alive[0]:
            raise OSError(errno.ESRCH, "gone")
        return [1 for _ in addrs]

    pages = PageNodes(clock=lambda: now[0], query=query)
    assert pages.node(5, 0x1000) == 1
    now[0], alive[0] = 1_500_000_000, False
    assert pages.node(5, 0x1000) == 1 and pages.node(5, 0x2000) is None and pages.gone == {5}
    assert pages.node(5, 0x1000) == 1


def test_copy_rows_say_host_device_or_unknown():
    def query(pid: int, addrs: list[int]) -> list[int]:
        if pid == 3:
            raise OSError(errno.ESRCH, "gone")
        return [1 if a < 0x100000 else -errno.ENOENT for a in addrs]

    pages = PageNodes(clock=lambda: 0, query=query)
    batch = pages.copy_rows([10, 11, 12], [7, 7, 8], [2, 2, 3], [0x1000, 0x700000000000, 0x1000], [100, 200, 300])
    rows = batch.to_pandas()
    assert rows["state"].tolist() == [HOST, NOT_HOST, UNKNOWN]
    assert rows["node"].tolist() == [1, -1, -1] and rows["size"].tolist() == [100, 200, 300]
    assert pages.gone == {3}


def test_policy_of_the_mapping_holding_an_address():
    text = ("00400000 default file=/usr/bin/python3 mapped=10 N0=10\n"
            "7f0000000000 bind:1 anon=256 dirty=256 N1=256\n"
            "7f1000000000 interleave:0-1 anon=2 N0=1 N1=1\n")
    policies = numa_policies(text)
    assert policy_at(policies, 0x7F0000001234) == "bind:1"
    assert policy_at(policies, 0x7F1000000000) == "interleave:0-1"
    assert policy_at(policies, 0x1000) == ""
    buf, addr = _own_pages(1)
    own = numa_policies(Path("/proc/self/numa_maps").read_text())
    assert policy_at(own, addr) == "default"
    del buf


def test_thread_affinity_of_this_thread():
    cpus, mems = thread_affinity(os.getpid(), os.getpid())
    assert allowed_cpus(cpus) == os.sched_getaffinity(0) and mems == "0"
    assert thread_affinity(os.getpid(), 1 << 30) is None


def _pci(root: Path, name: str, node: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "numa_node").write_text(node + "\n")


def test_gpu_node_from_the_pci_device(tmp_path):
    _pci(tmp_path, "0000:19:00.0", "1")
    _pci(tmp_path, "0001:3b:00.0", "0")
    _pci(tmp_path, "0000:1a:00.0", "-1")
    assert procfs.pci_numa_node("00000000:19:00.0", tmp_path) == 1  # NVML's 8-digit domain, upper case
    assert procfs.pci_numa_node("00000001:3B:00.0", tmp_path) == 0
    assert procfs.pci_numa_node("0000:1A:00.0", tmp_path) is None  # -1: no node
    assert procfs.pci_numa_node("00000000:99:00.0", tmp_path) is None
    gpus = [{"index": 0, "uuid": "u0", "bus_id": "00000000:19:00.0"},
            {"index": 1, "uuid": "u1", "bus_id": "00000001:3B:00.0", "node": None}]
    topo = procfs.topology(gpus, None, tmp_path)
    assert [g["node"] for g in topo["gpus"]] == [1, 0] and topo["gpu_node"] is None
    assert procfs.topology(gpus[:1], None, tmp_path)["gpu_node"] == 1


def test_nvml_node_first_and_a_declared_node_overrides(tmp_path):
    _pci(tmp_path, "0000:19:00.0", "0")
    said = [{"index": 0, "uuid": "u0", "bus_id": "00000000:19:00.0", "node": 1}]
    assert procfs.topology(said, None, tmp_path)["gpu_node"] == 1  # NVML's answer before the PCI device's
    declared = {"nodes": {"0": [0], "1": [1]}, "gpus": []}
    topo = procfs.topology(said, declared, tmp_path)
    assert topo["gpu_node"] == 1 and topo["nodes"] == declared["nodes"] and topo["declared"]
    declared["gpus"] = [{"index": 0, "node": 0, "bus_id": None}]
    assert procfs.topology(said, declared, tmp_path)["gpu_node"] == 0


def test_remote_copy_share_through_analysis_into_the_health_series(tmp_path):
    s = cuda_trainer()
    s.meta["topology"] = {"nodes": {"0": [0], "1": [1]}, "gpus": [{"index": 0, "bus_id": None, "node": 1}],
                          "gpu_node": 1, "declared": True}
    for i, node in enumerate((0, 0, 0, 1)):
        s.add("copy_node", ts_ns=t(1.0 + i), tid=TRAINER, pid=TRAINER,
              addr=0x1000, size=1 << 20, node=node, state="host", name="default")
    result = _assess(tmp_path, s)
    assert result.targets[0].remote_copy_share == pytest.approx(0.75)
    values = parse_exposition(render_textfile(result))
    assert values[("trainbpf_target_numa_remote_copy_ratio", (("pid", str(TRAINER)),))] == pytest.approx(0.75)
