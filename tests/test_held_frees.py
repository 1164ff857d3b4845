"""CUDA frees held back by events (analyzers/causes/held_frees.py), their place in the
buffers report and in the freed_late finding; on synthetic traces."""

from __future__ import annotations

import pytest

from report_contract import validate_report
from synth import FAULT_STACK, FUTEX_STACK, NS, START_NS, Synth
from trainbpf.analyzers.causes.held_frees import HELD_COLUMNS, held_events, held_frees
from trainbpf.analyzers.intervals import Span
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report
from trainbpf.reports.html import render_html
from trainbpf.reports.text import render_text

TRAINER, CONTROL, WAITER, LOADER = 100, 300, 400, 200
STREAM, EVENT = 0x5151, 0xE000
PINNED = 4 << 20
STEP_S = 0.05


def call(s: Synth, tid: int, ts: float, name: str, state: str, addr: int = 0, *, size: int = 0, ret: int = 0,
         stream: int = 0, nested: int = 0) -> None:
    s.add("cuda_call", ts_ns=START_NS + int(ts * NS), dur_ns=20_000, tid=tid, pid=TRAINER, name=name, state=state,
          op=nested, addr=addr, size=size, count=ret, ustack_id=-1, runq_ns=stream)


def pinned_ring(s: Synth, tid: int, base: int, steps: int, not_ready: int, *, depth: int = 3) -> None:
    """Each step pins a fresh buffer and records an event for it on STREAM; `depth`
    steps later the thread queries that event (`not_ready` queries answered not ready,
    then one ready, each 2 ms apart) and frees the buffer."""
    for i in range(steps):
        x = i * STEP_S
        call(s, tid, x, "cudaHostAlloc", "alloc", base + i * PINNED, size=PINNED)
        call(s, tid, x + 0.001, "cudaEventRecord", "event", EVENT + tid + i % (depth + 1), stream=STREAM)
        call(s, tid, x + 0.001, "cuEventRecord", "event", EVENT + tid + i % (depth + 1), stream=STREAM, nested=1)
        if i < depth:
            continue
        event, q = EVENT + tid + (i - depth) % (depth + 1), x + 0.01
        for k in range(not_ready):
            call(s, tid, q + k * 0.002, "cudaEventQuery", "event", event, ret=600)
            call(s, tid, q + k * 0.002, "cuEventQuery", "event", event, ret=600, nested=1)
        call(s, tid, q + not_ready * 0.002, "cudaEventQuery", "event", event)
        call(s, tid, q + not_ready * 0.002 + 0.001, "cudaFreeHost", "free", base + (i - depth) * PINNED)


def held_trace(tmp_path):
    s = Synth(duration_s=3)
    s.thread(TRAINER, "python")
    s.thread(CONTROL, "control", pid=TRAINER)
    s.thread(WAITER, "waiter", pid=TRAINER)
    pinned_ring(s, TRAINER, 0x7F1000000000, 40, not_ready=5)
    pinned_ring(s, CONTROL, 0x7F2000000000, 40, not_ready=0)  # its events are ready at once
    for i in range(10):  # a stream made to wait on an event before each device free
        x = 0.1 + i * 0.2
        call(s, WAITER, x, "cudaMalloc", "alloc", 0x700000000000 + i * PINNED, size=PINNED)
        call(s, WAITER, x + 0.01, "cudaEventRecord", "event", 0xF000, stream=0x7777)
        call(s, WAITER, x + 0.02, "cudaStreamWaitEvent", "event", 0xF000, stream=0x8888)
        call(s, WAITER, x + 0.05, "cudaFree", "free", 0x700000000000 + i * PINNED)
    s.oncpu_every(TRAINER, 0.0, 2.5, hz=100, pystack=("release_batches (/srv/train.py:40)",))
    s.gpu_series(lambda ts: 50.0, period=0.05)
    return s.read(tmp_path)


def test_frees_after_not_ready_queries_are_held_back_by_their_event(tmp_path):
    trace = held_trace(tmp_path)
    held = held_frees(trace.view("cuda_call"), Span(START_NS, START_NS + 3 * NS))
    assert list(held.columns) == list(HELD_COLUMNS)
    assert set(held["tid"]) == {TRAINER, WAITER}  # the control's events were ready: nothing held
    mine = held[held["tid"] == TRAINER]
    assert len(mine) == 37 and (mine["queries"] == 5).all() and (mine["waits"] == 0).all()  # driver twins left out
    assert (mine["stream"] == STREAM).all() and (mine["memory"] == "cuda_host").all()
    assert ((mine["free_ns"] - mine["first_ns"] - 11_000_000).abs() < 1000).all()
    assert sorted(set(mine["event"])) == [EVENT + TRAINER + k for k in range(4)]
    waited = held[held["tid"] == WAITER]
    assert len(waited) == 10 and (waited["waits"] == 1).all() and (waited["queries"] == 0).all()
    assert (waited["stream"] == 0x7777).all() and (waited["memory"] == "cuda_device").all()
    events = held_events(held)
    assert events["tid"].tolist() == [TRAINER, WAITER, TRAINER, TRAINER, TRAINER]  # the most frees, queries first
    assert events["frees"].tolist() == [10, 10, 9, 9, 9] and events["queries"].tolist()[:2] == [50, 0]
    assert events["held_ms"].tolist()[:2] == pytest.approx([11.0, 30.0], abs=0.01)


def test_the_report_names_the_event_that_held_frees_back(tmp_path):
    report = Report.of(analyze(held_trace(tmp_path)))
    validate_report(report.doc)
    section = report.doc["buffers"]
    trainer = [e for e in section["held_back"] if e["tid"] == TRAINER]
    assert trainer and trainer[0]["queries"] == 5 * trainer[0]["frees"] and trainer[0]["stream"] == STREAM, trainer
    assert trainer[0]["function"] == "release_batches (/srv/train.py:40)", trainer[0]
    assert CONTROL not in {e["tid"] for e in section["held_back"]}
    text = render_text(report)
    line = (f"CUDA frees held back by event {trainer[0]['event']:#x} (recorded on stream {STREAM:#x}): 5 queries "
            f"over 11 ms before each of {trainer[0]['frees']} frees, by python (100) in release_batches "
            "(/srv/train.py:40)")
    assert line in text, text
    assert "CUDA pinned host" in text and "CUDA device" in text, text
    assert "frees held back by event 0xf000 (recorded on stream 0x7777): 1 stream waits over 30 ms" in text, text
    assert "do: release each buffer at the step boundary after an explicit stream sync" in text, text
    assert "size the pool to the pipeline's depth" in text
    assert "<li>CUDA frees held back by event" in render_html(report)


def test_a_freed_late_finding_names_the_event_its_unmapper_waited_for(tmp_path):
    """A loader's batches the trainer unmaps 8 steps late, the trainer polling an event
    before each of its pinned frees: the freed_late finding names that event."""
    s = Synth(duration_s=6)
    s.thread(TRAINER, "python")
    s.thread(LOADER, "loader", pid=TRAINER)
    s.oncpu_every(LOADER, 0.0, 5.0, hz=100, kstack=FAULT_STACK, pystack=("load_batch (/srv/data.py:31)",))
    base, batch = 0x7F0000000000, 8 << 20
    for i in range(50):
        x = i * 0.1
        s.mm_syscall(LOADER, x, 0.0001, "mmap", batch, addr=0, ret=base + (i % 9) * (batch + 4096))
        s.faults(LOADER, x, 0.1, 2048)
        s.offcpu(TRAINER, x + 0.002, 0.097, waker=LOADER, kstack=FUTEX_STACK)
        s.futex(TRAINER, x + 0.002, 0.097, 0xABC0)
        if i >= 8:
            s.mm_syscall(TRAINER, x + 0.001, 0.0001, "munmap", batch, addr=base + ((i - 8) % 9) * (batch + 4096))
    pinned_ring(s, TRAINER, 0x7F1000000000, 40, not_ready=5)
    s.gpu_series(lambda ts: 3.0, period=0.05)
    report = Report.of(analyze(s.read(tmp_path)))
    validate_report(report.doc)
    [f] = [f for f in report.doc["findings"] if f["category"] == "allocator_churn"]
    assert f["evidence"]["case"] == "freed_late", f["evidence"]
    [e, *_] = f["evidence"]["held_back"]
    assert e["tid"] == TRAINER and e["stream"] == STREAM and e["queries"] == 5 * e["frees"], e
    assert f"; frees held back by event {e['event']:#x} (recorded on stream 0x5151): 5 queries" in f["summary"], \
        f["summary"]
