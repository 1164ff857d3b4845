"""Memory pressure as recorded: the page cache every file gains, loses and gets back
(probes/pagecache.bpf.c, `page_cache` rows) and the traced processes' memory cgroup
(tracer/samplers/memcg.py, `memory_cgroup` rows), from one recording of two children in
a fresh memory-limited cgroup: one reads a file twice with its pages dropped between the
reads, the other writes a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_env import memory_cgroup, require_root
from recording import record_workload
from trainbpf.tracer.disks import whole_disk

pytestmark = pytest.mark.kernel
MiB = 1 << 20
READ_MB, WRITE_MB = 8, 4
LIMIT = 256 * MiB
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_root()
    folder = tmp_path_factory.mktemp("pagecache")
    read_file, write_file = folder / "dataset.bin", folder / "ckpt.bin"
    read_file.write_bytes(os.urandom(READ_MB * MiB))
    fd = os.open(read_file, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not refaulted
    os.close(fd)
    with memory_cgroup(LIMIT) as procs:
        rec = record_workload(folder / "trace.parquet", "page_cache", str(read_file), str(write_file), WRITE_MB,
                              cgroup_procs=procs, probes=["pagecache"])
    return rec, read_file, write_file, procs.parent


def _pages(rows, path: Path) -> dict[str, int]:
    mine = rows[rows.inode == os.stat(path).st_ino]
    return mine.groupby("change")["pages"].sum().to_dict()


def _disk(path: Path) -> str:
    st = os.stat(path)
    return whole_disk(os.major(st.st_dev), os.minor(st.st_dev))


def test_a_file_read_dropped_and_read_again_is_counted_as_refaulted(recorded):
    rec, read_file, _, _ = recorded
    rows = rec.trace.view("page_cache")
    pages = READ_MB * MiB // PAGE
    got = _pages(rows, read_file)
    assert 2 * pages <= got.get("added", 0) <= 2.2 * pages, got  # two reads; readahead stops at the end
    assert pages <= got.get("dropped", 0) <= 1.1 * pages, got
    assert pages <= got.get("refaulted", 0) <= 1.1 * pages, f"the second read's pages are refaults: {got}"
    assert set(rows[rows.inode == os.stat(read_file).st_ino].device) == {_disk(read_file)}
    assert rec.trace.meta["lost"]["pagecache"] == 0


def test_a_written_file_is_counted_and_rows_span_their_bucket(recorded):
    rec, _, write_file, _ = recorded
    rows = rec.trace.view("page_cache")
    got = _pages(rows, write_file)
    assert got.get("added", 0) >= WRITE_MB * MiB // PAGE and not got.get("refaulted"), got
    width = rec.trace.meta["thresholds"]["disk_bucket_ns"]
    assert width == 100_000_000
    assert (rows.dur_ns == width).all() and (rows.ts_ns % width == 0).all()


def test_the_childrens_memory_cgroup_is_sampled_with_its_limit(recorded):
    rec, read_file, _, folder = recorded
    rows = rec.trace.view("memory_cgroup")
    mine = rows[rows.cgroup == "/" + folder.name]
    assert len(mine), f"no rows for the cgroup /{folder.name}: {sorted(set(rows.cgroup))}"
    assert set(mine.pid) <= {rec.pid, *rec.tids.values()}
    version = 2 if folder.parent == Path("/sys/fs/cgroup") else 1
    by_key = mine.groupby("key")
    assert set(by_key["value"].max()[["version"]]) == {version}
    assert set(mine[mine.key == "max"].value) == {LIMIT}
    assert {"usage", "file", "anon", "file_dirty", "file_writeback", "workingset_refault_file"} <= set(mine.key)
    times = sorted(set(mine.ts_ns))
    assert len(times) >= 3, "read at the start, every 500 ms and at the stop"
    assert rec.trace.meta["thresholds"]["cgroup_sample_ns"] == 500_000_000
    # the reader's file was cached while it slept between its reads
    assert mine[mine.key == "file"].value.max() >= READ_MB * MiB


def test_the_page_cache_probe_is_recorded_only_when_asked_for():
    """It runs for every page cache change on the machine (docs/performance.md): opt-in."""
    from trainbpf.tracer import loader
    from trainbpf.tracer.settings import Settings

    def names(asked):
        return [c.name for c in loader.select(asked, Settings())]

    assert "pagecache" not in names(None)
    assert sorted(names(["default", "pagecache"])) == sorted([*names(None), "pagecache"])
    assert names(["pagecache"]) == ["sched", "pagecache"]
