"""Finding and reading a process's memory cgroup (tracer/samplers/memcg.py) on fake
/proc and cgroup trees: v2 (a cgroup2 mount with the memory controller) and v1 (a
`memory` hierarchy); the real v1 case is recorded in tests/test_pagecache.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainbpf.tracer.samplers import memcg

V2_STAT = "anon 1000\nfile 5000\nkernel 7\nfile_dirty 300\nfile_writeback 40\nworkingset_refault_file 12\n"
V1_STAT = ("cache 1\nrss 2\ndirty 3\nwriteback 4\nworkingset_refault_file 5\n"
           "total_cache 5000\ntotal_rss 1000\ntotal_dirty 300\ntotal_writeback 40\ntotal_workingset_refault_file 12\n")


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _proc(tmp_path: Path, mountinfo: str, cgroups: dict[int, str]) -> Path:
    proc = tmp_path / "proc"
    _write(proc / "self", {"mountinfo": mountinfo})
    for pid, text in cgroups.items():
        _write(proc / str(pid), {"cgroup": text})
    return proc


def _v2(tmp_path: Path, *, high: str = "max") -> tuple[Path, Path]:
    root = tmp_path / "cgroup2"
    _write(root, {"cgroup.controllers": "cpuset cpu io memory pids\n"})
    job = root / "train.slice" / "job-1"
    _write(job, {"memory.max": "268435456\n", "memory.high": f"{high}\n", "memory.current": "200000\n",
                 "memory.stat": V2_STAT})
    mountinfo = (f"31 23 0:28 / /sys rw - sysfs sysfs rw\n"
                 f"41 31 0:38 / {root} rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n")
    return root, _proc(tmp_path, mountinfo, {10: "0::/train.slice/job-1\n", 11: "0::/train.slice/job-1\n",
                                             12: "0::/other\n"})


def _rows(sampler: memcg.CgroupSampler, pids: list[int], **kw) -> dict[tuple[str, str], int]:
    batch = sampler.take(123, pids, **kw)
    view = batch.to_pandas() if batch is not None else None
    return {} if view is None else {(r["name"], r["state"]): (r["pid"], r["count"]) for _, r in view.iterrows()}


def test_v2_cgroup_found_below_its_mount_and_read_once_for_its_processes(tmp_path):
    _, proc = _v2(tmp_path, high="134217728")
    rows = _rows(memcg.CgroupSampler(proc=proc), [11, 10])
    cg = "/train.slice/job-1"
    assert {k: v for (c, k), (_, v) in rows.items() if c == cg} == {
        "version": 2, "max": 268435456, "high": 134217728, "usage": 200000, "file": 5000, "anon": 1000,
        "file_dirty": 300, "file_writeback": 40, "workingset_refault_file": 12}
    assert {pid for (c, _), (pid, _) in rows.items() if c == cg} == {10}, "one process names the cgroup"


def test_unlimited_max_and_high_give_no_row(tmp_path):
    root, proc = _v2(tmp_path)
    (root / "train.slice" / "job-1" / "memory.max").write_text("max\n")
    keys = {k for (_, k) in _rows(memcg.CgroupSampler(proc=proc), [10])}
    assert "max" not in keys and "high" not in keys and "usage" in keys


def test_v2_without_the_memory_controller_is_not_a_memory_hierarchy(tmp_path):
    root, proc = _v2(tmp_path)
    (root / "cgroup.controllers").write_text("cpu io pids\n")
    assert memcg.CgroupSampler(proc=proc).take(1, [10]) is None


def test_v1_memory_line_is_read_with_its_hierarchical_totals(tmp_path):
    mount = tmp_path / "memory"
    _write(mount / "job", {"memory.limit_in_bytes": "67108864\n", "memory.usage_in_bytes": "4096\n",
                           "memory.stat": V1_STAT})
    _write(mount / "free", {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "1\n",
                            "memory.stat": ""})
    mountinfo = (f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n"
                 f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw\n")
    proc = _proc(tmp_path, mountinfo, {20: "5:devices:/\n4:memory:/job\n0::/\n", 21: "4:memory:/free\n0::/\n"})
    rows = _rows(memcg.CgroupSampler(proc=proc), [20, 21])
    assert {k: v for (c, k), (_, v) in rows.items() if c == "/job"} == {
        "version": 1, "max": 67108864, "usage": 4096, "file": 5000, "anon": 1000, "file_dirty": 300,
        "file_writeback": 40, "workingset_refault_file": 12}
    assert ("/free", "max") not in rows, "v1's largest limit means unlimited"


def test_a_cgroup_outside_the_mounts_subtree_is_not_read(tmp_path):
    mount = tmp_path / "memory"
    _write(mount, {"memory.usage_in_bytes": "1\n"})
    mountinfo = f"35 31 0:32 /container {mount} rw - cgroup cgroup rw,memory\n"
    proc = _proc(tmp_path, mountinfo, {30: "4:memory:/elsewhere\n", 31: "4:memory:/container\n"})
    sampler = memcg.CgroupSampler(proc=proc)
    assert sampler.cgroups([30]) == {}
    assert list(sampler.cgroups([31])) == [memcg.MemoryCgroup(1, "/container", mount)]


def test_the_last_read_keeps_cgroups_whose_processes_exited(tmp_path):
    _, proc = _v2(tmp_path)
    sampler = memcg.CgroupSampler(proc=proc)
    assert _rows(sampler, [10])
    (proc / "10" / "cgroup").unlink()  # the process is gone
    assert _rows(sampler, [10]) == {}
    assert ("/train.slice/job-1", "usage") in _rows(sampler, [10], final=True)


@pytest.mark.parametrize("escaped, path", [(r"/mnt/cg\040v2", "/mnt/cg v2")])
def test_mountinfo_escapes_are_undone(tmp_path, escaped, path):
    found = memcg.hierarchies(f"35 31 0:32 / {escaped} rw - cgroup cgroup rw,memory\n")
    assert found[1].mountpoint == Path(path)


def test_v2_mount_showing_a_subtree_and_a_process_in_the_root(tmp_path):
    """A cgroup namespace (or a bind mount) shows a subtree of the v2 hierarchy at the
    mount: its root field is that cgroup's path.  A cgroup without the controller's
    files (as the hierarchy's root, which cgroup-v2.rst exempts from resource control)
    gives the version alone."""
    mount = tmp_path / "ns"
    _write(mount, {"cgroup.controllers": "memory pids\n"})
    _write(mount / "job-1", {"memory.max": "1048576\n", "memory.current": "4096\n", "memory.stat": V2_STAT})
    mountinfo = f"41 31 0:38 /train.slice {mount} rw - cgroup2 cgroup2 rw,nsdelegate\n"
    proc = _proc(tmp_path, mountinfo, {40: "0::/train.slice/job-1\n", 41: "0::/elsewhere\n", 42: "0::/train.slice\n"})
    sampler = memcg.CgroupSampler(proc=proc)
    assert list(sampler.cgroups([40])) == [memcg.MemoryCgroup(2, "/train.slice/job-1", mount / "job-1")]
    assert sampler.cgroups([41]) == {}, "outside what the mount shows"
    rows = _rows(sampler, [40, 42])
    assert {k for (c, k) in rows if c == "/train.slice/job-1"} >= {"max", "usage", "file", "anon"}
    assert {k for (c, k) in rows if c == "/train.slice"} == {"version"}


def test_a_cgroups_files_are_opened_once_and_read_afresh(tmp_path, monkeypatch):
    """Sampled every 500 ms, a cgroup's files stay open and are re-read from the start
    (an open, read and close each time cost twice as much), each read seeing the value
    of the moment."""
    import os

    root, proc = _v2(tmp_path)
    sampler = memcg.CgroupSampler(proc=proc)
    opened: list[str] = []
    real_os_open, real_open = os.open, open
    monkeypatch.setattr(memcg.os, "open", lambda p, *a, **k: opened.append(str(p)) or real_os_open(p, *a, **k))
    monkeypatch.setattr(memcg, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k),
                        raising=False)
    cg = "/train.slice/job-1"
    assert _rows(sampler, [10])[(cg, "usage")] == (10, 200000)
    (root / "train.slice" / "job-1" / "memory.current").write_text("300000\n")
    assert _rows(sampler, [10])[(cg, "usage")] == (10, 300000)
    assert sorted(p.rsplit("/", 1)[1] for p in opened if "/memory." in p) == [
        "memory.current", "memory.high", "memory.max", "memory.stat"]
    sampler.close()
    assert not sampler.files.fds
