"""Memory culprits (issue 29, item 4): a memory_reclaim finding names the cgroup it
reclaimed in, its limit and what filled it (the page cache of which file, dirtied by
whom, or its processes' own memory); a block_io finding whose reads were pages the page
cache had dropped names the file read again and the file that pushed it out.  Synthetic
traces with a known answer (the recording side: tests/test_pagecache_probe.py)."""

from __future__ import annotations

from synth import RECLAIM_STACK, TRAINER, Synth, periodic
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, build_report
from trainbpf.reports.text import render_text

WRITER = 150
SHARD, DATASET, CKPT, SPILL = 71, 72, 73, 74
CGROUP = "/train.slice/job-1"
MiB = 1 << 20


def _top(s: Synth, tmp_path) -> dict:
    s.gpu_from_running(TRAINER)
    return build_report(analyze(s.read(tmp_path)))["findings"][0]


def _reclaiming(file_bytes: int, anon_bytes: int, dirty_bytes: int = 0) -> Synth:
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(WRITER, "shard_writer")
    s.file(SHARD, "/data/shards/shard0.bin")
    s.file(DATASET, "/data/other.bin", pid=4242)  # another process's file: not this cgroup's
    s.file(SPILL, "/data/spill.bin")
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.1, 0.1, state="D", kstack=RECLAIM_STACK)
        s.reclaim(TRAINER, x + 0.1, 0.1, state="memcg")
    for x in periodic(0.0, s.duration_s, 0.5):
        for key, value in (("max", 256 * MiB), ("usage", 255 * MiB), ("file", file_bytes), ("anon", anon_bytes),
                           ("file_dirty", dirty_bytes)):
            s.memory_cgroup(x, CGROUP, key, value)
    for x in periodic(0.0, s.duration_s, 0.1):
        s.page_cache(x, SHARD, "added", 2048)
        s.page_cache(x, DATASET, "added", 4096)  # more, but not the job's
        s.dirtied(WRITER, x, SHARD, 2048, comm="shard_writer")
        s.dirtied(TRAINER, x, SPILL, 4096)  # the trainer's own spill file: not what pushed it into reclaim
    return s


def test_reclaim_names_the_cgroup_its_limit_and_the_file_that_filled_it(tmp_path):
    f = _top(_reclaiming(file_bytes=200 * MiB, anon_bytes=40 * MiB, dirty_bytes=120 * MiB), tmp_path)
    assert f["category"] == "memory_reclaim" and f["evidence"]["case"] == "page_cache"
    assert f"reclaim in cgroup {CGROUP} (memory limit 268 MB), 78% of it page cache" in f["summary"], f["summary"]
    assert f"most of it /data/shards/shard0.bin, dirtied by shard_writer ({WRITER})" in f["summary"], f["summary"]
    assert "so reclaim waited for the disk" in f["summary"]
    assert "shard_writer" in f["recommendation"] and "not the problem" in f["recommendation"]
    assert [c["kind"] for c in f["culprits"]][1:3] == ["cgroup", "file"], f["culprits"]
    cgroup = next(c for c in f["culprits"] if c["kind"] == "cgroup")
    assert cgroup["name"] == CGROUP and cgroup["limit_bytes"] == 256 * MiB


def test_without_the_page_cache_probe_the_dirtied_files_are_named(tmp_path):
    s = _reclaiming(file_bytes=200 * MiB, anon_bytes=40 * MiB)
    s.rows["page_cache"].clear()  # recorded without the opt-in pagecache probe
    f = _top(s, tmp_path)
    assert f["evidence"]["case"] == "page_cache"
    assert f"most of it /data/shards/shard0.bin, dirtied by shard_writer ({WRITER})" in f["summary"], f["summary"]
    assert [c.get("dirtied_bytes") for c in f["culprits"] if c["kind"] == "file"] == [100 * 2048 * 4096]


def test_reclaim_of_the_processes_own_memory_says_so(tmp_path):
    f = _top(_reclaiming(file_bytes=20 * MiB, anon_bytes=230 * MiB), tmp_path)
    assert f["evidence"]["case"] == "anon"
    assert "mostly anonymous memory (241 MB) of its processes" in f["summary"], f["summary"]
    assert "raise memory.max" in f["recommendation"]


def test_reclaim_without_cgroup_rows_reads_as_before(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.1, 0.1, state="D", kstack=RECLAIM_STACK)
    f = _top(s, tmp_path)
    assert f["category"] == "memory_reclaim" and "case" not in f["evidence"] and "cgroup" not in f["evidence"]


def _refaulting(tmp_path, *, rewritten: bool = False, busy_writer: bool = False) -> dict:
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(WRITER, "ckpt_writer")
    s.file(DATASET, "/data/dataset.bin")
    s.file(CKPT, "/data/ckpt.pt")
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.1, 0.1, state="D")
        s.block_rq(TRAINER, x + 0.101, 0.098, size=MiB, dev=254 << 20)
    for x in periodic(0.0, s.duration_s, 0.1):
        s.disk_io(TRAINER, x, bytes=4 * MiB)
        s.page_cache(x, DATASET, "refaulted", 768)  # 3 MiB of the 4 read
        s.page_cache(x, CKPT, "added", 8192)
        s.dirtied(WRITER, x, CKPT, 8192, comm="ckpt_writer")
        if rewritten:  # the "dataset" is rewritten: its pages come back after truncation
            s.dirtied(WRITER, x, DATASET, 768, comm="ckpt_writer")
        if busy_writer:
            s.disk_io(WRITER, x, bytes=40 * MiB, direction="write", comm="ckpt_writer")
    return _top(s, tmp_path)


def test_a_dataset_read_again_after_a_checkpoint_evicted_it_is_named(tmp_path):
    f = _refaulting(tmp_path)
    assert f["category"] == "block_io" and f["evidence"]["case"] == "refault", f["summary"]
    assert "re-read 157 MB of /data/dataset.bin after the page cache dropped it for /data/ckpt.pt written by " \
           f"ckpt_writer ({WRITER})" in f["summary"], f["summary"]
    assert "ckpt_writer" in f["recommendation"]


def test_the_text_report_lists_the_cgroup_and_the_files(tmp_path):
    s = _reclaiming(file_bytes=200 * MiB, anon_bytes=40 * MiB)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    text = render_text(Report(analysis=a, doc=build_report(a)))
    assert f"    cgroup: {CGROUP} (limit 268 MB, usage 267 MB, page cache 210 MB, anonymous 41.9 MB)" in text, text
    assert "    file: /data/shards/shard0.bin (839 MB dirtied, 839 MB added to the page cache)" in text, text


def test_pages_back_after_a_rewrite_are_not_refaults(tmp_path):
    f = _refaulting(tmp_path, rewritten=True)
    assert "refaulted" not in f["evidence"]["io"] and "case" not in f["evidence"], f["summary"]


def test_a_refault_is_said_beside_another_culprit(tmp_path):
    f = _refaulting(tmp_path, busy_writer=True)
    assert f["evidence"]["case"] == "other_io", f["summary"]
    assert f["summary"].endswith("behind 2.1 GB of I/O by ckpt_writer (150); it re-read 157 MB of /data/dataset.bin "
                                 "after the page cache dropped it for /data/ckpt.pt written by ckpt_writer (150) "
                                 "(95% of starved time)"), f["summary"]
    again = [c for c in f["culprits"] if c.get("refaulted_bytes")]
    assert [c["name"] for c in again] == ["/data/dataset.bin"]


def test_evidence_rows_without_threads_are_every_threads_inside_the_window():
    """page_cache.py's files filled over the window are every thread's rows of it: the
    window's one filter (EvidenceContext.rows), not a copy of it."""
    import pandas as pd

    from trainbpf.analyzers.causes.evidence import EvidenceContext
    from trainbpf.analyzers.intervals import Span

    empty = pd.DataFrame()
    rows = pd.DataFrame({"ts_ns": [5, 10, 15, 20], "dur_ns": [1] * 4, "tid": [1, 2, 3, 1]})
    ctx = EvidenceContext(window=Span(10, 20), threads=empty, slots=empty, trainer_states=empty, futex_waits=empty,
                          stacks=empty, frames={"dirtied": rows}, churn=empty, placement=empty)
    assert ctx.rows("dirtied")["ts_ns"].tolist() == [10, 15]
    assert ctx.rows("dirtied", [2])["ts_ns"].tolist() == [10]
    assert not len(ctx.rows("page_cache"))
