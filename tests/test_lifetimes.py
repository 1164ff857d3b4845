"""Buffer lifetimes (analyzers/causes/lifetimes.py): mappings paired with their
unmappings, per size class how long buffers live, how many are alive at once and the
faults a step, on synthetic traces."""

from __future__ import annotations

import numpy as np
import pytest

from synth import NS, START_NS, Synth
from trainbpf.analyzers.causes.lifetimes import LIFETIME_COLUMNS, buffers, lifetimes
from trainbpf.analyzers.intervals import Span

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
