"""When the library probes (tracer/libprobe.py) read a traced process's maps again: only
when it has mapped code since, not at every flush of a process that maps and unmaps
memory (a trainer's allocator does so all the time; each read of its maps costs ~0.5 ms)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from trainbpf.tracer import libprobe
from trainbpf.tracer.collector import ThreadTable
from trainbpf.tracer.libprobe import LibraryCalls, LibraryCollector
from trainbpf.tracer.settings import Settings

LIBRARY = "libbz2.so.1.0"  # a library a bare Python does not map until asked

CHILD = r"""
import ctypes, mmap, sys
held = []
for line in sys.stdin:
    if line.startswith("map"):
        held.append(mmap.mmap(-1, 64 << 20))  # anonymous memory: no code
        held[-1][0] = 1
    elif line.startswith("load"):
        ctypes.CDLL(%r)
    print("done", flush=True)
""" % LIBRARY


class Bz2Calls(LibraryCollector):
    name = "bz2_test"
    calls = LibraryCalls(path_re=re.compile(r"libbz2\.so"), marker="libbz2", symbol_re=r"(BZ2_bzCompress)$")

    def __init__(self):
        super().__init__(Settings())
        self.attached: list[str] = []

    def attach_call(self, bpf, opened: str, sym: str, base: str) -> None:
        self.attached.append(sym)


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(what: str) -> None:
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"

    try:
        ask("ready")  # its imports done: it maps no more code unless asked
        yield proc.pid, ask
    finally:
        proc.kill()
        proc.wait()


def _collector(pid: int) -> Bz2Calls:
    c = Bz2Calls()
    threads = ThreadTable()
    threads.tgid[pid] = pid
    c.threads = threads
    return c


def test_maps_are_not_read_again_when_only_memory_was_mapped(child, monkeypatch):
    pid, ask = child
    collector = _collector(pid)
    reads = []
    real_open = open
    monkeypatch.setattr(libprobe, "open", lambda path, *a, **k: reads.append(path) or real_open(path, *a, **k),
                        raising=False)
    collector.scan(None)
    assert reads == [f"/proc/{pid}/maps"], "the first scan reads the maps"
    ask("map")
    collector.scan(None)
    assert reads == [f"/proc/{pid}/maps"], "64 MiB of anonymous memory mapped: no code, the maps are not read again"


def test_a_library_mapped_since_is_found_at_the_next_scan(child):
    pid, ask = child
    collector = _collector(pid)
    collector.scan(None)
    assert not collector.libraries
    ask("map")
    ask("load")
    collector.scan(None)
    assert [lib["path"].rsplit("/", 1)[-1].startswith(LIBRARY) for lib in collector.libraries.values()] == [True]
    assert collector.attached == ["BZ2_bzCompress"]
    collector.close()
