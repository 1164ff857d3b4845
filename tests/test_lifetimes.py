"""Buffer lifetimes (analyzers/causes/lifetimes.py): mappings paired with their
unmappings, per size class how long buffers live, how many are alive at once and the
faults a step, on synthetic traces."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from report_contract import validate_report
from synth import FAULT_STACK, FUTEX_STACK, NS, START_NS, Synth
from trainbpf.analyzers.causes.lifetimes import LIFETIME_COLUMNS, buffers, busy_period_starts, held_class, lifetimes
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.buffers import buffer_culprits
from trainbpf.reports.document import Report
from trainbpf.reports.html import render_html
from trainbpf.reports.text import render_text

LOADER, TRAINER = 200, 100
BATCH = 8 << 20
STEP_S = 0.1
BASE = 0x7F0000000000


def pipeline(tmp_path, depth: int, steps: int = 50):
    """A loader maps a fresh batch every step; the trainer unmaps it `depth` steps later
    (depth 0: the loader unmaps it at once).  Each batch faults in its 2048 pages."""
    s = Synth(duration_s=steps * STEP_S + 1)
    s.thread(TRAINER, "python")
    s.thread(LOADER, "loader", pid=TRAINER)
    for i in range(steps):
        x = i * STEP_S
        addr = BASE + (i % (depth + 1)) * (BATCH + 4096)  # addresses come back once unmapped
        s.mm_syscall(LOADER, x, 0.0001, "mmap", BATCH, addr=0, ret=addr)
        s.faults(LOADER, x, STEP_S, 2048)
        if depth == 0:
            s.mm_syscall(LOADER, x + 0.05, 0.0001, "munmap", BATCH, addr=addr)
        elif i + depth < steps:
            s.mm_syscall(TRAINER, x + depth * STEP_S - 0.01, 0.0001, "munmap", BATCH, addr=addr)
    s.mm_syscall(LOADER, 0.0, 0.0001, "brk", 1 << 20)  # the heap's end: no buffer
    s.mm_syscall(LOADER, 0.0, 0.0001, "mmap", BATCH, ret=-12)  # ENOMEM: no buffer
    trace = s.read(tmp_path)
    starts = START_NS + (np.arange(steps) * STEP_S * NS).astype(np.int64)
    return trace, starts, Span(START_NS, START_NS + int(steps * STEP_S * NS))


def test_held_batches_live_depth_steps_and_pile_up(tmp_path):
    trace, starts, span = pipeline(tmp_path, depth=8)
    bufs = buffers(trace.view("mm_syscall"))
    assert len(bufs) == 50  # the brk and the failed mmap are no buffers
    assert (bufs["unmap_tid"][:42] == TRAINER).all() and (bufs["unmap_ns"][42:] == -1).all()
    table = lifetimes(bufs, trace.view("faults"), starts, span)
    assert list(table.columns) == list(LIFETIME_COLUMNS)
    [row] = table.itertuples()
    assert row.size_class == BATCH and row.buffers == 50 and row.freed == 42
    assert row.alive_at_once == 8 and row.alive_max == 8
    assert row.lifetime_steps == 8 and row.lifetime_s == pytest.approx(0.79, abs=0.002)
    assert row.maps_per_step == 1.0 and row.faults_per_step == pytest.approx(2048)
    assert row.map_tid == LOADER and row.unmap_tid == TRAINER


def test_batches_freed_at_once_live_within_their_step(tmp_path):
    trace, starts, span = pipeline(tmp_path, depth=0)
    [row] = lifetimes(buffers(trace.view("mm_syscall")), trace.view("faults"), starts, span).itertuples()
    assert row.freed == 50 and row.alive_max == 1 and row.lifetime_steps == 1
    assert row.unmap_tid == LOADER


def test_without_steps_lifetimes_are_in_seconds(tmp_path):
    trace, _, span = pipeline(tmp_path, depth=8)
    [row] = lifetimes(buffers(trace.view("mm_syscall")), trace.view("faults"), None, span).itertuples()
    assert np.isnan(row.lifetime_steps) and np.isnan(row.faults_per_step)
    assert row.faults_per_s == pytest.approx(2048 / STEP_S) and row.alive_at_once == 8


def test_mremap_moves_a_buffer(tmp_path):
    s = Synth(duration_s=2)
    s.thread(TRAINER, "python")
    s.mm_syscall(TRAINER, 0.1, 0.0001, "mmap", BATCH, addr=0, ret=BASE)
    s.mm_syscall(TRAINER, 0.5, 0.0001, "mremap", 2 * BATCH, addr=BASE, ret=BASE + (1 << 30))
    s.mm_syscall(TRAINER, 0.9, 0.0001, "munmap", 2 * BATCH, addr=BASE + (1 << 30))
    bufs = buffers(s.read(tmp_path).view("mm_syscall"))
    assert bufs["size_class"].tolist() == [BATCH, 2 * BATCH]
    life = ((bufs["unmap_ns"] - bufs["map_ns"]) / NS).round(2).tolist()
    assert life == [0.4, 0.4]


def test_empty_trace_gives_an_empty_table(tmp_path):
    s = Synth(duration_s=1)
    s.thread(TRAINER, "python")
    trace = s.read(tmp_path)
    table = lifetimes(buffers(trace.view("mm_syscall")), trace.view("faults"), None, Span(START_NS, START_NS + NS))
    assert list(table.columns) == list(LIFETIME_COLUMNS) and not len(table)


def analysed(tmp_path, depth: int, gpu=lambda ts: 3.0):
    """The trainer's own pipeline of `depth` analysed and reported: it maps, faults in (60%
    of its samples in the fault path) and unmaps its batches itself."""
    s = Synth(duration_s=6)
    s.thread(TRAINER, "python")
    s.thread(LOADER, "loader", pid=TRAINER)
    s.oncpu_every(TRAINER, 0.0, 5.0, hz=100, kstack=lambda ts: FAULT_STACK if (ts * 100) % 10 < 6 else None,
                  pystack=("load_batch (/srv/data.py:31)", "<module> (/srv/train.py:9)"))
    for i in range(50):
        x = i * STEP_S
        addr = BASE + (i % (depth + 1)) * (BATCH + 4096)
        s.mm_syscall(TRAINER, x, 0.0001, "mmap", BATCH, addr=0, ret=addr)
        s.faults(TRAINER, x, STEP_S, 2048)
        if depth == 0:
            s.mm_syscall(TRAINER, x + 0.05, 0.0001, "munmap", BATCH, addr=addr)
        elif i >= depth:
            s.mm_syscall(TRAINER, x + 0.001, 0.0001, "munmap", BATCH, addr=BASE + ((i - depth) % (depth + 1)) * (BATCH + 4096))
    s.gpu_series(gpu, period=0.05)
    report = Report.of(analyze(s.read(tmp_path)))
    validate_report(report.doc)
    return report


def test_held_batches_are_a_freed_late_finding(tmp_path):
    report = analysed(tmp_path, depth=8)
    [f] = [f for f in report.doc["findings"] if f["category"] == "allocator_churn"]
    assert f["evidence"]["case"] == "freed_late", f["evidence"]
    held = f["evidence"]["held_buffers"]
    assert held["size_class"] == BATCH and held["alive_at_once"] == 9 and held["map_tid"] == TRAINER
    assert "fresh 8 MiB buffers: each lives 0.80 s (9 alive at once)" in f["summary"], f["summary"]
    assert ("mapped by python (100) in load_batch (/srv/data.py:31), unmapped by python (100) in load_batch "
            "(/srv/data.py:31)") in f["summary"], f["summary"]
    assert "keep a pool of 9 buffers" in f["recommendation"] and "explicit stream sync" in f["recommendation"]
    [culprit] = [c for c in f["culprits"] if c["kind"] == "thread"]
    assert culprit["tid"] == TRAINER and culprit["mapper"] and culprit["unmapper"], f["culprits"]
    assert culprit["function"] == "load_batch (/srv/data.py:31)", culprit
    [row] = report.doc["buffers"]["size_classes"]
    assert report.doc["buffers"]["unit"] == "seconds" and row["alive_at_once"] == 9 and row["unmap_tid"] == TRAINER
    text = render_text(report)
    assert "Buffer lifetimes" in text and "8 MiB" in text and "9 (max 9)" in text, text
    html = render_html(report)
    assert "<h2>Buffer lifetimes</h2>" in html and "<td>9 (max 9)</td>" in html


def test_batches_freed_at_once_are_no_freed_late_finding(tmp_path):
    report = analysed(tmp_path, depth=0)
    [f] = [f for f in report.doc["findings"] if f["category"] == "allocator_churn"]
    # (its 4 KiB pages may still make it the small_pages case)
    assert f["evidence"].get("case") != "freed_late" and "held_buffers" not in f["evidence"], f["evidence"]
    assert report.doc["buffers"]["size_classes"][0]["alive_max"] == 1


def test_a_mapping_thread_outside_the_finding_is_named_as_holder():
    evidence = {"case": "freed_late", "mapper": {"tid": 100, "comm": "python", "role": "trainer", "function": ""},
                "unmapper": {"tid": 200, "comm": "loader", "role": "dataloader", "function": "free (/srv/d.py:3)"}}
    rows = buffer_culprits([{"kind": "thread", "name": "python", "tid": 100, "pid": 100}], evidence, {200: 100})
    assert rows == [{"kind": "thread", "name": "python", "tid": 100, "pid": 100, "mapper": True},
                    {"kind": "thread", "name": "loader", "tid": 200, "pid": 100, "holder": True, "unmapper": True,
                     "function": "free (/srv/d.py:3)"}]
    assert buffer_culprits([], {}, {}) == []


def test_gpu_busy_periods_are_the_steps_without_cuda(tmp_path):
    """A GPU busy for the first half of every 0.1 s step: a buffer freed 8 steps after
    it was mapped lived in 9 of them, and each step pays its batch's faults."""
    report = analysed(tmp_path, depth=8, gpu=lambda ts: 90.0 if ts < 5 and round(ts / 0.05) % 2 == 0 else 0.0)
    [row] = report.doc["buffers"]["size_classes"]
    assert report.doc["buffers"]["unit"] == "steps", report.doc["buffers"]
    assert row["lifetime_steps"] == 9 and row["maps_per_step"] == pytest.approx(1.0, abs=0.05), row
    [f] = [f for f in report.doc["findings"] if f["category"] == "allocator_churn"]
    assert "each lives 9 steps (9 alive at once)" in f["summary"] and "every step pays 2," in f["summary"], f["summary"]


def test_busy_period_starts():
    w = pd.DataFrame({"gpu": ["a"] * 6 + ["b"], "start_ns": [0, 10, 20, 30, 40, 50, 0], "end_ns": [10, 20, 30, 40, 50, 60, 10],
                      "idle_ns": [1.0, 2.0, 9.0, 0.0, 10.0, 3.0, 0.0]})
    assert busy_period_starts(w).tolist() == [0, 30, 50]
    assert busy_period_starts(w.assign(idle_ns=0.0)).tolist() == []  # always busy: no rhythm
    assert busy_period_starts(w.iloc[:0]).tolist() == []


def cuda_call(s: Synth, tid: int, ts: float, name: str, state: str, ptr: int, size: int = 0, *, nested: int = 0,
              dur: float = 0.0002, ret: int = 0) -> None:
    s.add("cuda_call", ts_ns=START_NS + int(ts * NS), dur_ns=int(dur * NS), tid=tid, pid=TRAINER, name=name,
          state=state, op=nested, addr=ptr, size=size, count=ret, ustack_id=-1)


def test_cuda_allocations_are_paired_with_their_frees(tmp_path):
    """Pinned host batches held 4 deep and device buffers freed at once, each paired by
    pointer; the driver's nested call and a failed allocation are no buffers; CUDA's
    buffers take none of the host's faults and are no freed_late case of the faults."""
    s = Synth(duration_s=3)
    s.thread(TRAINER, "python")
    s.faults(TRAINER, 0.0, 2.0, 5000)
    host, dev = 0x7F1000000000, 0x700000000000
    for i in range(20):
        x = i * STEP_S
        cuda_call(s, TRAINER, x, "cudaHostAlloc", "alloc", host + (i % 5) * BATCH, BATCH)
        cuda_call(s, TRAINER, x, "cuMemHostAlloc", "alloc", host + (i % 5) * BATCH, BATCH, nested=1)
        if i >= 4:
            cuda_call(s, TRAINER, x + 0.01, "cudaFreeHost", "free", host + ((i - 4) % 5) * BATCH)
        cuda_call(s, TRAINER, x + 0.02, "cudaMalloc", "alloc", dev + i * (1 << 20), 1 << 20)
        cuda_call(s, TRAINER, x + 0.03, "cudaFree", "free", dev + i * (1 << 20))
    cuda_call(s, TRAINER, 2.5, "cudaMalloc", "alloc", 0, 1 << 20, ret=2)  # out of memory
    trace = s.read(tmp_path)
    bufs = buffers(trace.view("mm_syscall"), trace.view("cuda_call"))
    assert len(bufs) == 40 and set(bufs["memory"]) == {"cuda_host", "cuda_device"}
    table = lifetimes(bufs, trace.view("faults"), None, Span(START_NS, START_NS + 2 * NS))
    assert table[["memory", "size_class", "buffers", "freed", "alive_max"]].values.tolist() == [
        ["cuda_device", 1 << 20, 20, 20, 1], ["cuda_host", BATCH, 20, 16, 5]]
    assert table["alive_at_once"].tolist() == [1.0, 5.0] and (table["faults_per_s"] == 0).all()
    assert table["lifetime_s"].round(2).tolist() == [0.01, 0.41]
    assert held_class(table) is None


def test_a_loader_whose_batches_the_trainer_unmaps_churns(tmp_path):
    """A loader maps and faults in each batch, the trainer unmaps it 8 steps later while
    it waits for the next: the loader's churn, freed late, is named with both threads."""
    s = Synth(duration_s=6)
    s.thread(TRAINER, "python")
    s.thread(LOADER, "loader", pid=TRAINER)
    s.oncpu_every(LOADER, 0.0, 5.0, hz=100, kstack=FAULT_STACK, pystack=("load_batch (/srv/data.py:31)",))
    for i in range(50):
        x = i * STEP_S
        addr = BASE + (i % 9) * (BATCH + 4096)
        s.mm_syscall(LOADER, x, 0.0001, "mmap", BATCH, addr=0, ret=addr)
        s.faults(LOADER, x, STEP_S, 2048)
        s.offcpu(TRAINER, x + 0.002, 0.097, waker=LOADER, kstack=FUTEX_STACK)
        s.futex(TRAINER, x + 0.002, 0.097, 0xABC0)
        if i >= 8:
            s.mm_syscall(TRAINER, x + 0.001, 0.0001, "munmap", BATCH, addr=BASE + ((i - 8) % 9) * (BATCH + 4096))
    s.gpu_series(lambda ts: 3.0, period=0.05)
    report = Report.of(analyze(s.read(tmp_path)))
    validate_report(report.doc)
    [f] = [f for f in report.doc["findings"] if f["category"] == "allocator_churn"]
    assert f["evidence"]["case"] == "freed_late", f["evidence"]
    assert "mapped by loader (200) in load_batch (/srv/data.py:31), unmapped by python (100)" in f["summary"], f["summary"]
    by_tid = {c["tid"]: c for c in f["culprits"] if c["kind"] == "thread"}
    assert by_tid[LOADER]["mapper"] and by_tid[TRAINER]["unmapper"], f["culprits"]


def test_one_large_mapping_shows_no_lifetime_table(tmp_path):
    """A mapping held for the whole run is no churn: the JSON keeps its row, the text and
    HTML show no table."""
    s = Synth(duration_s=2)
    s.thread(TRAINER, "python")
    s.mm_syscall(TRAINER, 0.1, 0.0001, "mmap", 64 << 20, addr=0, ret=0x7F0000000000)
    s.gpu_series(lambda ts: 50.0, period=0.05)
    report = Report.of(analyze(s.read(tmp_path)))
    assert "Buffer lifetimes" not in render_text(report), render_text(report)
    assert "Buffer lifetimes" not in render_html(report)
    assert report.doc["buffers"]["size_classes"][0]["buffers"] == 1, report.doc["buffers"]
    validate_report(report.doc)
