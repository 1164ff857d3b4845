"""Whose I/O fills the disk (issue 29): block requests of every issuer counted in the
kernel (probes/disk.bpf.c), pages written back and folios dirtied per inode
(probes/writeback.bpf.c), and the files and devices they name (tracer/samplers/files.py),
on one real recording: a child writes a new file buffered and keeps it open, its parent
syncs (the flusher kworker writes the file back), another child reads a file with
O_DIRECT."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kernel_env import require_root
from recording import record_workload
from trainbpf.tracer.settings import Settings

WORKLOAD = Path(__file__).with_name("disk_workload.py")
WRITTEN = 8 << 20
READ = 4 << 20


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    require_root()
    folder = tmp_path_factory.mktemp("disk")
    read = folder / "dataset.bin"
    with open(read, "wb") as fh:  # on the disk before the recording: O_DIRECT reads it from there
        fh.write(os.urandom(READ))
        fh.flush()
        os.fsync(fh.fileno())
    written = folder / "ckpt.pt"
    rec = record_workload(folder / "trace.parquet", "", probes=["disk", "writeback"],
                          command=[sys.executable, str(WORKLOAD), str(written), str(WRITTEN), str(read), "1.2"])
    st = os.stat(written)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"  # / here: a whole disk (vda)
    return rec, st.st_ino, device, written


def test_the_flusher_issues_the_buffered_files_writes(disk):
    """sync hands the new file to the flusher: the kworker that wrote its inode back is
    the issuer of its requests (not the writer, nor the thread that called sync)."""
    rec, inode, device, _ = disk
    wb = rec.trace.view("writeback_inode")
    flushers = set(wb[(wb.inode == inode) & (wb.device == device)].tid)
    io = rec.trace.view("disk_io")
    writes = io[(io.direction == "write") & io.tid.isin(flushers) & (io.device == device)]
    assert writes.bytes.sum() >= WRITTEN, io.to_string()
    assert writes.comm.str.startswith("kworker/").all() and (writes.tid == writes.pid).all()
    assert writes.requests.sum() > 0


def test_the_direct_reader_issues_its_own_reads(disk):
    rec, _, device, _ = disk
    io = rec.trace.view("disk_io")
    reader = rec.tids["reader"]
    reads = io[(io.tid == reader["tid"]) & (io.direction == "read") & (io.device == device)]
    # its own bytes, and at most the little its interpreter's start read besides
    assert READ <= reads.bytes.sum() <= READ + (2 << 20), io.to_string()
    assert reads.requests.sum() >= READ // (1 << 20)


def test_disk_io_rows_are_whole_buckets_each_counted_once(disk):
    rec, *_ = disk
    io = rec.trace.view("disk_io")
    width = rec.trace.meta["thresholds"]["disk_bucket_ns"]
    assert width == Settings().disk_bucket_ns and (io.dur_ns == width).all() and (io.ts_ns % width == 0).all()
    assert not io.duplicated(["ts_ns", "device", "tid", "direction"]).any()  # a bucket cut by a flush is one row


def test_writeback_of_the_files_inode_by_the_flusher(disk):
    rec, inode, device, _ = disk
    wb = rec.trace.view("writeback_inode")
    mine = wb[(wb.inode == inode) & (wb.device == device)]
    assert rec.trace.meta["lost"]["writeback"] == 0
    assert mine.bytes.sum() >= WRITTEN, wb.to_string()
    assert mine.comm.str.startswith("kworker/").all()


def test_dirtied_folios_name_the_writer(disk):
    rec, inode, device, _ = disk
    dirtied = rec.trace.view("dirtied")
    mine = dirtied[(dirtied.inode == inode) & (dirtied.device == device)]
    # (an inode number freed during the recording may be reused: another task may have
    # dirtied the file that had it before)
    writer = mine[mine.tid == rec.tids["writer"]["tid"]]
    assert writer.folios.sum() > 0, dirtied.to_string()
    assert set(writer.pid) == {rec.tids["writer"]["tid"]}  # the writer is its process's main thread


def test_file_rows_name_the_path_and_devices_their_disk(disk):
    rec, inode, device, written = disk
    files = rec.trace.view("file")
    mine = files[(files.inode == inode) & (files.device == device)]
    assert mine.path.tolist() == [str(written)] and mine.pid.tolist() == [rec.tids["writer"]["tid"]], files.to_string()
    devices = rec.trace.view("block_device")
    assert devices[devices.device == device].name.tolist() == [os.path.basename(os.path.realpath(f"/sys/dev/block/{device}"))]
    assert not devices.device.duplicated().any()
    assert rec.trace.meta["files"]["named"] == len(files)


def test_unseen_issuers_are_unnamed():
    """Under sudo with /proc mounted hidepid, a task of a process the invoking user could
    not see is counted unnamed (docs/security.md)."""
    from trainbpf.tracer.bucketed import issuers

    cols = issuers([11, 21], [10, 20], ["mine", "theirs"], visible=lambda pid: pid == 10)
    assert cols["tid"].tolist() == [11, 0] and cols["pid"].to_pylist() == [10, None]
    assert cols["comm"].tolist() == ["mine", ""]


def test_disk_buckets_shorter_than_a_millisecond_are_refused():
    from trainbpf.trace.errors import UsageError

    with pytest.raises(UsageError, match="disk_bucket_ns"):
        Settings(disk_bucket_ns=1000)


def test_a_bucket_drained_while_counting_is_one_row_with_the_rest():
    """The kernel's hash is drained whole at each flush: the bucket still counting is
    kept and summed with what the next drain finds for it, so it is one row, complete."""
    import ctypes

    from trainbpf.tracer.bucketed import BucketCounts

    class Key(ctypes.Structure):
        _fields_ = [("bucket", ctypes.c_uint64), ("dev", ctypes.c_uint32), ("tid", ctypes.c_uint32),
                    ("direction", ctypes.c_uint32), ("pad", ctypes.c_uint32)]

    class Leaf(ctypes.Structure):
        _fields_ = [("bytes", ctypes.c_uint64), ("requests", ctypes.c_uint64), ("pid", ctypes.c_uint32),
                    ("pad", ctypes.c_uint32), ("comm", ctypes.c_char * 16)]

    class Table:  # what drain_hash reads of a bcc hash without batch calls
        def __init__(self):
            self.entries = []

        def __setitem__(self, key, leaf):
            self.entries.append((key, leaf))

        def __delitem__(self, key):
            self.entries = [(k, v) for k, v in self.entries if k is not key]

        def items(self):
            return list(self.entries)

    table = Table()
    table.Key, table.Leaf = Key, Leaf
    counts = BucketCounts("disk_counts", 100, ("bucket", "dev", "tid", "direction"), ("bytes", "requests"))
    table[Key(9, 7, 5, 1)] = Leaf(4096, 1, 5, 0, b"kworker/u8:1")
    table[Key(10, 7, 5, 1)] = Leaf(8192, 2, 5, 0, b"kworker/u8:1")
    def rows(now_ns: int, final: bool) -> list[tuple]:
        columns = counts.drain({"disk_counts": table}, now_ns, final=final)
        return list(zip(*(list(c) for c in columns.values())))

    assert rows(1050, final=False) == [(9, 7, 5, 1, 4096, 1, 5, "kworker/u8:1")]
    assert not table.entries
    table[Key(10, 7, 5, 1)] = Leaf(4096, 1, 5, 0, b"kworker/u8:1")
    table[Key(10, 8, 6, 0)] = Leaf(100, 1, 6, 0, b"other")  # another key in the same bucket
    assert rows(1150, final=False) == [(10, 7, 5, 1, 12288, 3, 5, "kworker/u8:1"), (10, 8, 6, 0, 100, 1, 6, "other")]
    table[Key(11, 7, 5, 1)] = Leaf(512, 1, 5, 0, b"kworker/u8:1")
    assert rows(1150, final=True) == [(11, 7, 5, 1, 512, 1, 5, "kworker/u8:1")]


def test_the_recorder_counts_none_of_its_own_io(disk):
    rec, *_ = disk
    for kind in ("disk_io", "writeback_inode", "dirtied"):
        assert not (rec.trace.view(kind).pid == os.getpid()).any(), kind
