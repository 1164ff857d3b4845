"""Disk culprits (issue 29, item 2): a block_io or dirty_throttling finding names what
made the disk busy (the device, the file written back, the thread that dirtied it, or
another issuer) from the recorder's per-device counts, and its summary and advice follow
the culprit; the victim's own I/O alone keeps the storage advice.  Synthetic traces with
a known answer (the recording side: tests/test_disk_probes.py)."""

from __future__ import annotations

from synth import TRAINER, Synth, periodic
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, build_report
from trainbpf.reports.html import render_html
from trainbpf.reports.text import render_text

WRITER = 150  # a checkpoint thread of the trainer's process
FLUSHER = 300
INODE = 77
CKPT = "/data/ckpt/ckpt-0.pt"
MiB = 1 << 20


def _victim_reads(s: Synth) -> None:
    """The trainer blocks reading from vda for the last 100 ms of every 200 ms."""
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.1, 0.1, state="D")
        s.block_rq(TRAINER, x + 0.101, 0.098, size=MiB, dev=254 << 20)


def _trace(tmp_path, busy, name="trace.parquet"):
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(WRITER, "ckpt_writer")
    s.block_device("254:0", "vda")
    s.file(INODE, CKPT)
    _victim_reads(s)
    for x in periodic(0.0, s.duration_s, 0.1):
        s.disk_io(TRAINER, x, bytes=MiB // 2)
        busy(s, x)
    s.gpu_from_running(TRAINER)
    return analyze(s.read(tmp_path, name))


def _writeback(s: Synth, x: float) -> None:
    s.disk_io(FLUSHER, x, bytes=20 * MiB, direction="write", comm="kworker/u8:1+flush-254:0", pid=FLUSHER)
    s.writeback_inode(x, INODE, 20 * MiB)
    s.dirtied(WRITER, x, INODE, 5120, comm="ckpt_writer")
    s.write_path(WRITER, x, INODE, "buffered", 20 * MiB)


def _report_top(a) -> dict:
    return build_report(a)["findings"][0]


def test_another_writers_writeback_is_the_culprit_and_the_advice_is_about_it(tmp_path):
    f = _report_top(_trace(tmp_path, _writeback))
    assert f["category"] == "block_io"
    assert f["evidence"]["case"] == "writeback"
    assert f"writeback of {CKPT}, dirtied by ckpt_writer ({WRITER})" in f["summary"], f["summary"]
    # 20 MiB a bucket, the waits whole buckets, every other one: 50 of them
    assert "on vda behind 1.05 GB of writeback" in f["summary"], f["summary"]
    kinds = {c["kind"]: c for c in f["culprits"] if c["kind"] != "thread" or c["tid"] != TRAINER}
    assert kinds["device"]["name"] == "vda"
    assert kinds["file"]["name"] == CKPT and kinds["file"]["write_paths"] == ["buffered"]
    assert kinds["thread"]["tid"] == WRITER and kinds["thread"]["folios"] > 0
    assert "ckpt_writer" in f["recommendation"] and "O_DIRECT" in f["recommendation"]
    assert "faster storage" not in f["recommendation"]


def _mapped_writeback(s: Synth, x: float) -> None:
    s.disk_io(FLUSHER, x, bytes=20 * MiB, direction="write", comm="kworker/u8:1+flush-254:0", pid=FLUSHER)
    s.writeback_inode(x, INODE, 20 * MiB)
    s.dirtied(WRITER, x, INODE, 5120, comm="ckpt_writer")
    s.write_path(WRITER, x, INODE, "mapped", 20 * MiB)


def test_a_checkpoint_written_through_a_mapping_is_said_and_still_advised_o_direct(tmp_path):
    """Stores into a shared mapping are written back like buffered writes: the writer is
    the culprit, the path is said, and O_DIRECT or io_uring is still the advice."""
    a = _trace(tmp_path, _mapped_writeback)
    f = _report_top(a)
    assert f["evidence"]["case"] == "writeback"
    assert f"dirtied by ckpt_writer ({WRITER}) through a shared mapping" in f["summary"], f["summary"]
    assert "ckpt_writer writes through a shared mapping (mmap)" in f["recommendation"], f["recommendation"]
    assert "O_DIRECT or io_uring" in f["recommendation"] and "through the page cache" not in f["recommendation"]
    file = next(c for c in f["culprits"] if c["kind"] == "file")
    assert file["write_paths"] == ["mapped"]
    text = render_text(Report(analysis=a, doc=build_report(a)))
    assert f"    file: {CKPT} (1.05 GB written back, written through a shared mapping)" in text, text


def test_tasks_seen_only_in_machine_wide_counts_are_not_traced_threads(tmp_path):
    report = build_report(_trace(tmp_path, _writeback))
    assert FLUSHER not in {t["tid"] for t in report["threads"]}


def test_the_victims_own_io_alone_keeps_the_storage_advice(tmp_path):
    f = _report_top(_trace(tmp_path, lambda s, x: None))
    assert f["category"] == "block_io" and "case" not in f["evidence"]
    assert "faster storage" in f["recommendation"]
    assert [c["kind"] for c in f["culprits"]] == ["thread", "device"]
    assert f["evidence"]["io"]["victim_bytes"] == f["evidence"]["io"]["bytes"] > 0


def test_a_writer_already_on_o_direct_is_told_the_device_is_the_limit(tmp_path):
    def direct(s, x):
        s.disk_io(WRITER, x, bytes=20 * MiB, direction="write", comm="ckpt_writer")
        s.write_path(WRITER, x, INODE, "direct", 20 * MiB)

    f = _report_top(_trace(tmp_path, direct))
    assert f["evidence"]["case"] == "direct_writes"
    assert f"O_DIRECT writes to {CKPT} by ckpt_writer ({WRITER})" in f["summary"], f["summary"]
    assert "already writes" in f["recommendation"] and "bandwidth is the limit" in f["recommendation"]
    assert not f["evidence"]["io"]["files"], "no writeback culprit"


def test_another_process_reading_is_named(tmp_path):
    def scan(s, x):
        s.disk_io(4242, x, bytes=30 * MiB, comm="updatedb", pid=4242)

    f = _report_top(_trace(tmp_path, scan))
    assert f["evidence"]["case"] == "other_io"
    assert "I/O by updatedb (4242)" in f["summary"]
    assert {"kind": "process", "name": "updatedb", "tid": 4242, "pid": 4242} .items() <= \
        next(c for c in f["culprits"] if c.get("tid") == 4242).items()


def test_an_unnamed_inode_is_said_by_number_and_device(tmp_path, monkeypatch):
    monkeypatch.setattr(Synth, "file", lambda self, *a, **k: None)  # the recorder never saw the file open
    f = _report_top(_trace(tmp_path, _writeback))
    assert f"writeback of inode {INODE} on vda" in f["summary"], f["summary"]


def test_a_trace_without_device_counts_reads_as_before(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    _victim_reads(s)
    s.gpu_from_running(TRAINER)
    f = _report_top(analyze(s.read(tmp_path)))
    assert f["category"] == "block_io" and "io" not in f["evidence"] and "case" not in f["evidence"]


def test_a_throttled_writer_names_the_thread_that_dirtied_most(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(WRITER, "ckpt_writer")
    s.file(INODE, CKPT)
    s.block_device("254:0", "vda")
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.1, 0.1, state="D")
        s.dirty_pause(TRAINER, x + 0.1, 0.1, dev="254:0")
    for x in periodic(0.0, s.duration_s, 0.1):
        s.dirtied(TRAINER, x, 9, 16)  # its own spill file
        s.dirtied(WRITER, x, INODE, 2560, comm="ckpt_writer")
        s.disk_io(FLUSHER, x, bytes=10 * MiB, direction="write", comm="kworker/u8:1+flush-254:0", pid=FLUSHER)
    s.gpu_from_running(TRAINER)
    f = _report_top(analyze(s.read(tmp_path)))
    assert f["category"] == "dirty_throttling" and f["evidence"]["case"] == "writeback"
    assert f"ckpt_writer ({WRITER}) dirtied" in f["summary"] and CKPT in f["summary"], f["summary"]
    assert "ckpt_writer" in f["recommendation"]


def test_the_text_report_lists_the_disk_culprits(tmp_path):
    a = _trace(tmp_path, _writeback)
    text = render_text(Report(analysis=a, doc=build_report(a)))
    assert "    disk: vda (254:0), 1.07 GB of requests during the waits" in text, text
    assert f"    file: {CKPT} (1.05 GB written back, written buffered)" in text, text
    assert f"    dirtied by: ckpt_writer ({WRITER}, pid 100), 512000 folios" in text, text


def test_the_html_report_lists_the_disk_culprits(tmp_path):
    a = _trace(tmp_path, _writeback)
    html = render_html(Report(analysis=a, doc=build_report(a)))
    assert f"<p><b>Culprits:</b><br>disk: vda (254:0), 1.07 GB of requests during the waits<br>file: {CKPT} " in html


def test_discards_are_not_data_moved(tmp_path):
    """A discard covers whole extents freed: its size is no measure of the load."""
    f = _report_top(_trace(tmp_path, lambda s, x: s.disk_io(4242, x, bytes=100 * MiB, direction="other",
                                                             comm="fstrim", pid=4242)))
    assert "case" not in f["evidence"] and "faster storage" in f["recommendation"], f["summary"]


def test_a_writer_throttled_by_its_own_dirty_pages_blames_no_one_else(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    s.block_device("254:0", "vda")
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.1, 0.1, state="D")
        s.dirty_pause(TRAINER, x + 0.1, 0.1, dev="254:0")
    for x in periodic(0.0, s.duration_s, 0.1):
        s.dirtied(TRAINER, x, INODE, 2560)  # its own file, written back by the flusher
        s.disk_io(FLUSHER, x, bytes=10 * MiB, direction="write", comm="kworker/u8:1+flush-254:0", pid=FLUSHER)
    s.gpu_from_running(TRAINER)
    f = _report_top(analyze(s.read(tmp_path)))
    assert f["category"] == "dirty_throttling" and "case" not in f["evidence"], f["summary"]
