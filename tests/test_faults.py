"""The faults collector on real threads: the kernel's per-thread counters read between
two reads, and a thread's last faults from its taskstats exit message."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time

import pytest

from kernel_env import require_root
from trainbpf.tracer import proctree
from trainbpf.tracer.collector import ThreadTable
from trainbpf.tracer.collectors import faults as faults_mod
from trainbpf.tracer.collectors.faults import FaultsCollector, exit_faults
from trainbpf.tracer.settings import Settings

PAGES = 2048  # 8 MiB, one fault a page
READ_EVERY_NS = 1  # each sample() reads


def touch(pages: int) -> None:
    m = mmap.mmap(-1, pages * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    for off in range(0, pages * 4096, 4096):
        m[off] = 1
    m.close()


def counted(collector: FaultsCollector, tid: int, *, final: bool = False) -> int:
    """What the collector's rows give `tid`, reading once more first."""
    now = time.monotonic_ns()
    collector.sample(now)  # reads: READ_EVERY_NS has passed
    batches = collector.drain(None, now + 1, final=final)
    total = 0
    for b in batches:
        rows = b.to_pydict()
        total += sum(c for t, c in zip(rows["tid"], rows["count"]) if t == tid)
        assert all(d >= 0 for d in rows["dur_ns"])
    return total


@pytest.fixture
def collector():
    require_root("registers for taskstats exit messages")
    table = ThreadTable()
    pid = os.getpid()
    walked = proctree.threads_of(pid)
    for t in walked:
        table.tgid[t.tid] = pid
    c = FaultsCollector(Settings(fault_bucket_ns=READ_EVERY_NS))
    c.seeded(None, walked, table, time.monotonic_ns())
    yield c, table
    c.close()


def test_a_living_thread_is_counted_between_reads(collector):
    c, _ = collector
    tid = threading.get_native_id()
    counted(c, tid)  # whatever this thread did before
    touch(PAGES)
    n = counted(c, tid)
    assert PAGES <= n <= PAGES + 256, n  # beyond the pages: the interpreter's own allocations


def test_a_thread_born_and_gone_between_reads_is_counted_from_its_exit(collector):
    c, table = collector
    out = {}

    def worker():
        out["tid"] = threading.get_native_id()
        touch(PAGES)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    time.sleep(0.05)  # reaped; its exit message is on the socket
    # What the recorder's thread table learns at the flush: born here, exited.
    table.tgid[out["tid"]] = os.getpid()
    table.exited.add(out["tid"])
    n = counted(c, out["tid"])
    assert PAGES <= n <= PAGES + 256, n


def test_a_thread_read_then_gone_gets_the_rest_from_its_exit(collector):
    c, table = collector
    out = {}
    started, go = threading.Event(), threading.Event()

    def worker():
        out["tid"] = threading.get_native_id()
        touch(PAGES)
        started.set()
        go.wait()
        touch(PAGES)  # after the read below, then it exits

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    first = counted(c, out["tid"])  # found in the task list, read while alive
    go.set()
    t.join()
    time.sleep(0.05)
    table.tgid[out["tid"]] = os.getpid()
    table.exited.add(out["tid"])
    rest = counted(c, out["tid"])
    assert PAGES <= first <= PAGES + 256, first
    assert PAGES <= rest <= PAGES + 256, rest


def test_exits_of_other_processes_are_not_ours(collector):
    c, _ = collector
    pid = os.fork()
    if pid == 0:
        touch(256)
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.05)
    assert counted(c, pid) == 0  # its exit message came, but the thread table does not know it


def test_without_taskstats_a_thread_gone_between_reads_is_missed_and_said(monkeypatch):
    require_root()
    notes = []

    def refuse():
        raise OSError("no taskstats here")

    monkeypatch.setattr(faults_mod, "ExitListener", refuse)
    table = ThreadTable()
    c = FaultsCollector(Settings(fault_bucket_ns=READ_EVERY_NS))
    c.notice = notes.append
    c.seeded(None, proctree.threads_of(os.getpid()), table, time.monotonic_ns())
    try:
        out = {}
        t = threading.Thread(target=lambda: (out.setdefault("tid", threading.get_native_id()), touch(256)))
        t.start()
        t.join()
        time.sleep(0.05)  # the thread itself gone, not only its Python side
        table.tgid[out["tid"]] = os.getpid()
        table.exited.add(out["tid"])
        assert counted(c, out["tid"]) == 0
        assert notes and "taskstats" in notes[0]
        assert c.meta()["faults"]["exit_counts"] == 0
    finally:
        c.close()


def test_exit_message_parser_survives_any_bytes():
    rng = random.Random(7)
    for _ in range(2000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 700)))
        assert isinstance(exit_faults(data), dict)
    assert exit_faults(b"") == {}


def test_past_the_held_descriptors_a_thread_is_read_by_path(monkeypatch):
    """Node-wide every thread on the machine is read: past MAX_HELD_STAT_FILES the
    collector opens each thread's stat file at each read instead of holding it."""
    require_root()
    monkeypatch.setattr(faults_mod, "MAX_HELD_STAT_FILES", 0)
    table = ThreadTable()
    c = FaultsCollector(Settings(fault_bucket_ns=READ_EVERY_NS))
    c.seeded(None, proctree.threads_of(os.getpid()), table, time.monotonic_ns())
    try:
        tid = threading.get_native_id()
        counted(c, tid)
        touch(PAGES)
        assert PAGES <= counted(c, tid) <= PAGES + 256
        assert c._held == 0
    finally:
        c.close()
