"""vmstat and PSI sampling (tracer/samplers/procfs.py ProcSampler) against this machine's /proc,
and the parsing of both files' text."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from trainbpf.tracer.samplers import procfs


def test_vmstat_text_keeps_the_stall_counters_and_negative_gauges():
    text = b"nr_free_pages 1000\nnr_dirty -3\npgfault 42\npgmajfault 1\nnr_zone_active_anon 7\ncompact_stall 5\n"
    assert procfs.parse_vmstat(text) == {"nr_dirty": -3, "pgfault": 42, "pgmajfault": 1, "compact_stall": 5}


def test_psi_text_gives_each_lines_total():
    text = b"some avg10=0.00 avg60=0.11 avg300=0.59 total=4977848\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=12\n"
    assert procfs.parse_psi("io", text) == {"io.some": 4977848, "io.full": 12}
    assert procfs.parse_psi("cpu", b"some avg10=0.00 avg60=0.00 avg300=0.00 total=9\n") == {"cpu.some": 9}


def _rows(batches) -> dict[str, dict[str, tuple[int, int]]]:
    """kind -> name -> (count, dur_ns)"""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for b in batches:
        d = b.to_pydict()
        for kind, name, count, dur in zip(d["kind"], d["name"], d["count"], d["dur_ns"]):
            out.setdefault(kind, {})[name] = (count, dur)
    return out


def _touch(mib: int) -> None:
    with mmap.mmap(-1, mib << 20) as m:
        m.madvise(mmap.MADV_NOHUGEPAGE)  # a fault per 4 KiB page, whatever THP is set to
        for off in range(0, mib << 20, mmap.PAGESIZE):
            m[off] = 1


def test_a_sample_is_taken_once_its_interval_has_passed_or_at_the_stop():
    if not Path("/proc/vmstat").exists():
        pytest.skip("no /proc/vmstat on this machine")
    created_ns = time.monotonic_ns()
    sampler = procfs.ProcSampler(interval_ns=int(3600e9))
    try:
        assert sampler.take() == [], "sampled before its interval passed"
        _touch(8)  # 2048 page faults, re-read through the descriptor kept open
        first_ns = time.monotonic_ns()
        final = _rows(sampler.take(final=True))
        assert final["vmstat"]["pgfault"][0] >= 2048
        assert 0 < final["vmstat"]["pgfault"][1] <= time.monotonic_ns() - created_ns  # since it was made
        if Path("/proc/pressure/cpu").exists():
            assert "cpu.some" in final["psi"]
        _touch(8)
        again = _rows(sampler.take(final=True))  # a delta from the previous sample, not from the start
        cumulative = procfs.parse_vmstat(Path("/proc/vmstat").read_bytes())["pgfault"]
        assert 2048 <= again["vmstat"]["pgfault"][0] < cumulative
        assert 0 < again["vmstat"]["pgfault"][1] <= time.monotonic_ns() - first_ns
    finally:
        sampler.close()


def test_an_interval_of_zero_samples_every_time():
    sampler = procfs.ProcSampler(interval_ns=0)
    try:
        _touch(4)
        assert "vmstat" in _rows(sampler.take())
    finally:
        sampler.close()


def test_a_read_that_fails_once_gives_no_delta_from_zero():
    """One failed read of /proc/vmstat: the next good one is still a delta from the last
    good one, not the machine's count since boot."""
    sampler = procfs.ProcSampler(interval_ns=0)
    good = sampler._fds["vmstat"]
    failing = os.open("/", os.O_RDONLY | os.O_DIRECTORY)  # pread of a directory: EISDIR
    try:
        sampler._fds["vmstat"] = failing
        assert "pgfault" not in _rows(sampler.take()).get("vmstat", {})
        sampler._fds["vmstat"] = good
        _touch(4)
        delta = _rows(sampler.take())["vmstat"]["pgfault"][0]
        since_boot = procfs.parse_vmstat(Path("/proc/vmstat").read_bytes())["pgfault"]
        assert 1024 <= delta < since_boot / 2, (delta, since_boot)
    finally:
        os.close(failing)
        sampler.close()
