"""The write path of each file traced threads write (probes/writepath.bpf.c), recorded
once while four threads write a file each: buffered, O_DIRECT, through io_uring and
through a shared mapping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_env import require_root
from kernel_workloads import WRITE_CHUNK, WRITES
from recording import record_workload
from trainbpf.tracer.disks import device_name, whole_disk

pytestmark = pytest.mark.kernel
WRITTEN = WRITE_CHUNK * WRITES
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    require_root()
    folder = tmp_path_factory.mktemp("writepath")
    rec = record_workload(folder / "trace.parquet", "write_paths", str(folder), probes=["writepath"])
    return rec, folder, rec.trace.view("write_path")


def _disk(path: Path) -> str:
    st = os.stat(path)
    return whole_disk(os.major(st.st_dev), os.minor(st.st_dev))


@pytest.mark.parametrize("path", ["buffered", "direct"])
def test_a_file_written_by_syscalls_is_counted_on_its_path(written, path):
    rec, folder, rows = written
    file = folder / f"{path}.bin"
    mine = rows[rows.inode == os.stat(file).st_ino]
    assert set(mine.path) == {path}, f"{file.name} written as {sorted(set(mine.path))}"
    assert set(mine.tid) == {rec.tids[path]} and set(mine.pid) == {rec.pid}
    assert set(mine.device) == {_disk(file)}
    assert mine.bytes.sum() == WRITTEN and mine.calls.sum() == WRITES


def test_io_uring_writes_are_counted_per_thread_without_a_file(written):
    rec, folder, rows = written
    ring = rows[rows.tid == rec.tids["io_uring"]]
    assert list(ring.path.unique()) == ["io_uring"], "the ring's writes are neither buffered nor direct syscalls"
    assert ring.calls.sum() == WRITES
    assert (ring.inode == 0).all() and (ring.bytes == 0).all() and (ring.device == "").all()


def test_a_file_written_through_a_shared_mapping_is_counted_as_mapped(written):
    """Its pages are dirtied in the thread's page faults, outside any write syscall; the
    buffered io_uring writes, whose folios are dirtied inside io_uring_enter, are not."""
    rec, folder, rows = written
    file = folder / "mapped.bin"
    mine = rows[rows.inode == os.stat(file).st_ino]
    assert set(mine.path) == {"mapped"}, f"{file.name} written as {sorted(set(mine.path))}"
    assert set(mine.tid) == {rec.tids["mapped"]} and set(mine.pid) == {rec.pid}
    assert set(mine.device) == {_disk(file)}
    # a page a fault, or fewer faults where the page cache gave it larger folios
    assert mine.bytes.sum() == mine.calls.sum() * PAGE and 0 < mine.bytes.sum() <= WRITTEN, mine
    mapped = rows[rows.path == "mapped"]
    assert set(mapped.tid) == {rec.tids["mapped"]}, "only stores into a mapping count as mapped"


def test_rows_span_their_bucket(written):
    rec, _, rows = written
    width = rec.trace.meta["thresholds"]["disk_bucket_ns"]
    assert width == 100_000_000
    assert (rows.dur_ns == width).all() and (rows.ts_ns % width == 0).all()
    assert rec.trace.meta["lost"]["writepath"] == 0


def test_a_partition_is_named_by_its_disk(tmp_path):
    """/sys/dev/block/MAJ:MIN links into /sys/devices; a partition's folder, with a
    `partition` file, sits in its disk's."""
    disk = tmp_path / "devices" / "vda"
    (disk / "vda1").mkdir(parents=True)
    (disk / "dev").write_text("254:0\n")
    (disk / "vda1" / "dev").write_text("254:1\n")
    (disk / "vda1" / "partition").write_text("1\n")
    links = tmp_path / "block"
    links.mkdir()
    (links / "254:0").symlink_to(disk)
    (links / "254:1").symlink_to(disk / "vda1")
    assert whole_disk(254, 1, links) == "254:0"
    assert whole_disk(254, 0, links) == "254:0"
    assert whole_disk(0, 45, links) == "0:45"  # tmpfs, overlayfs: no block device
    assert [device_name(d, links) for d in ("254:0", "254:1", "0:45")] == ["vda", "vda1", None]
