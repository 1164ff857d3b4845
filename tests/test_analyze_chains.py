"""Wake-up chains: followed to the root cause over any number of links; cycles stop."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from synth import DIRTY_STACK, FAULT_STACK, FUTEX_STACK, SLEEP_STACK, TRAINER, Synth, periodic
from trainbpf.analyzers.causes.attribution import RunSplit
from trainbpf.analyzers.causes.chains import END_COLUMNS, LINK_COLUMNS, wait_chains
from trainbpf.analyzers.pipeline import analyze

PERIOD = 0.3
NAMES = {200: "pt_data_worker", 300: "ckpt_writer", 400: "python", 500: "python", 600: "python"}


def chain_trace(links: list[int], root: str = "dirty", cycle_to: int | None = None) -> Synth:
    """The trainer runs 100 ms then waits 200 ms for links[0], which was itself waiting
    for links[1], ... ; the last link is blocked by `root` ("dirty": balance_dirty_pages,
    "runnable": no CPU, "faulting": running in the page-fault path) or, with `cycle_to`,
    was woken by that earlier link of the chain."""
    s = Synth(duration_s=9.0)
    s.thread(TRAINER, "python")
    for tid in links:
        s.thread(tid, NAMES[tid])
    for x in periodic(0.0, 9.0, PERIOD):
        s.offcpu(TRAINER, x + 0.1, 0.2, waker=links[0], kstack=FUTEX_STACK)
        s.futex(TRAINER, x + 0.1, 0.2, addr=0x7F00_0000_1000)
        for i, tid in enumerate(links, 1):
            a, t = x + 0.05 - 0.01 * i, x + 0.3 - 0.01 * i  # ends just before it wakes link i-1
            last = i == len(links)
            if not last:
                s.offcpu(tid, a, t - a, waker=links[i], kstack=SLEEP_STACK)
            elif cycle_to is not None:
                s.offcpu(tid, a, t - a, waker=cycle_to, kstack=SLEEP_STACK)
            elif root == "dirty":
                s.offcpu(tid, a, t - a, state="D", kstack=DIRTY_STACK)
                s.dirty_pause(tid, a, t - a)
            elif root == "runnable":
                s.offcpu(tid, a, t - a, state="R", runq=t - a)
            elif root == "faulting":
                s.oncpu_every(tid, x, x + PERIOD, hz=200, kstack=FAULT_STACK)
    s.gpu_from_running(TRAINER)
    return s


def chain_of(finding) -> list[tuple[int, str]]:
    return [(c["tid"], c["state"]) for c in finding.chain]


def test_chain_of_three_ends_at_dirty_throttling(tmp_path):
    a = analyze(chain_trace([200, 300]).read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "dirty_throttling"
    # Each link ran 10 ms of its 200-250 ms wait before waking the next: those shares
    # are still-producing time, the rest ends at the writer's throttling.
    assert 0.85 <= f.share <= 0.95
    assert chain_of(f) == [(TRAINER, "futex"), (200, "sleep"), (300, "dirty_throttling")]
    assert [c["role"] for c in f.chain] == ["trainer", "dataloader", "checkpoint"]
    assert f.threads[0]["tid"] == 300
    assert not a.chain_ends["cycle"].any()
    # Every wait's shares add up to the whole wait.
    assert np.allclose(a.chain_ends.groupby("wait")["weight"].sum(), 1.0)


def test_chain_of_five(tmp_path):
    a = analyze(chain_trace([200, 400, 500, 300]).read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "dirty_throttling"
    assert [tid for tid, _ in chain_of(f)] == [TRAINER, 200, 400, 500, 300]
    assert a.chain_ends.groupby("wait")["depth"].max().min() == 4
    assert a.chains.groupby("wait")["depth"].max().min() == 3


def test_chain_ends_at_runnable_waker(tmp_path):
    a = analyze(chain_trace([200, 400], root="runnable").read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "cpu_contention"
    assert chain_of(f)[-1] == (400, "runnable")


def test_chain_ends_at_waker_running_in_fault_path(tmp_path):
    a = analyze(chain_trace([200], root="faulting").read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "page_faults"
    assert chain_of(f) == [(TRAINER, "futex"), (200, "running")]


def test_cycle_stops(tmp_path):
    a = analyze(chain_trace([200, 400], cycle_to=200).read(tmp_path))
    assert a.chain_ends["cycle"].any()
    assert a.chain_ends.groupby("wait")["depth"].max().max() <= 2
    f = a.findings.iloc[0]
    assert f.category == "other"
    assert [tid for tid, _ in chain_of(f)] == [TRAINER, 200, 400]


def test_self_wake_cycle_stops(tmp_path):
    a = analyze(chain_trace([200], cycle_to=200).read(tmp_path))
    assert a.chain_ends["cycle"].any()
    assert a.findings.iloc[0].category == "other"


def test_untraced_waker_is_other(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    for x in periodic(0.0, 10.0, 0.3):
        s.offcpu(TRAINER, x + 0.1, 0.2, waker=9999, kstack=SLEEP_STACK)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "other"
    assert chain_of(f) == [(TRAINER, "sleep"), (9999, "untraced")]


def test_wait_chains_terminates_on_mutual_wakeups(tmp_path):
    """Inconsistent input: two threads each blocked until the other woke them, at the
    same instant.  The chain stops at the cycle instead of looping."""
    s = Synth(duration_s=2.0)
    s.thread(TRAINER, "python")
    s.thread(200, "python")
    s.offcpu(TRAINER, 0.5, 1.0, waker=200)
    s.offcpu(200, 0.5, 1.0, waker=TRAINER)
    a = analyze(s.read(tmp_path))
    assert list(a.chains.columns) == list(LINK_COLUMNS)
    assert list(a.chain_ends.columns) == list(END_COLUMNS)
    assert a.chain_ends["cycle"].all()
    assert len(a.chains) == 1 and len(a.chain_ends) == 1


def test_wait_chains_empty_has_fixed_columns(tmp_path):
    s = Synth(duration_s=1.0)
    s.thread(TRAINER, "python")
    a = analyze(s.read(tmp_path))
    no_waits = pd.DataFrame({"wait": [], "tid": [], "start_ns": [], "end_ns": [], "waker_tid": [], "state": []})
    links, ends = wait_chains(no_waits, a.states, RunSplit(a.samples))
    assert list(links.columns) == list(LINK_COLUMNS) and list(ends.columns) == list(END_COLUMNS)
    assert links["depth"].dtype == np.int64 and ends["weight"].dtype == np.float64
    assert len(links) == len(ends) == 0


def queued_worker(competitor: str) -> Synth:
    """Worker 200 ran 40% of each trainer wait and sat runnable the other 60% while
    `competitor` (thread 300) held the only CPU."""
    s = Synth(duration_s=9.0)
    s.thread(TRAINER, "python")
    s.thread(200, "pt_data_worker")
    s.thread(300, competitor)
    for x in periodic(0.0, 9.0, PERIOD):
        s.offcpu(TRAINER, x + 0.1, 0.2, waker=200, kstack=FUTEX_STACK)
        s.offcpu(200, x + 0.1, 0.12, state="R", runq=0.12)
        s.offcpu(300, x, 0.1)  # 300 runs only while the worker is queued
        s.offcpu(300, x + 0.22, 0.08)
    s.gpu_from_running(TRAINER)
    return s


def test_worker_queued_behind_an_outsider_is_cpu_contention(tmp_path):
    a = analyze(queued_worker("logger").read(tmp_path))
    shares = dict(zip(a.findings["category"], a.findings["share"]))
    assert shares["cpu_contention"] == pytest.approx(0.6, abs=0.02)
    assert shares["input_pipeline"] == pytest.approx(0.4, abs=0.02)
    assert sum(shares.values()) <= 1.0 + 1e-9


def test_worker_queued_behind_another_worker_is_still_producing(tmp_path):
    a = analyze(queued_worker("pt_data_worker").read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "input_pipeline"
    # all of the trainer's waits; the rest of the starved time is its own host work
    assert f.seconds == pytest.approx((a.starved_ns - a.host_bound_ns) / 1e9, rel=0.02)


def test_waker_blocked_mostly_waiting_for_the_producer_follows_that_wait(tmp_path):
    """A worker's feeder thread (300) waits ~230 ms for the decoder (200) to hand it a
    batch, then ~10 ms for a contended lock, then writes the batch and wakes the trainer.
    Its long wait leads to the decoder's running (input_pipeline); only the lock wait's
    overlap is lock contention, not the whole blocked share."""
    lock = 0x7F00_0000_2000
    s = Synth(duration_s=9.0)
    s.thread(TRAINER, "python")
    s.thread(200, "pt_data_worker", pid=200)
    s.thread(300, "pt_data_worker", pid=200)
    s.thread(400, "pt_data_worker", pid=200)
    for x in periodic(0.0, 9.0, PERIOD):
        s.offcpu(TRAINER, x + 0.05, 0.25, waker=300, kstack=FUTEX_STACK)
        s.futex(TRAINER, x + 0.05, 0.25, addr=0x7F00_0000_1000)
        s.offcpu(300, x + 0.02, 0.26, waker=200, kstack=FUTEX_STACK)
        s.futex(300, x + 0.02, 0.26, addr=0x7F00_0000_3000)
        s.offcpu(300, x + 0.28, 0.01, waker=400, kstack=FUTEX_STACK)
        s.futex(300, x + 0.28, 0.01, addr=lock, ustack=("__lll_lock_wait", "pthread_mutex_lock"))
        s.offcpu(400, x + 0.27, 0.005, waker=300, kstack=FUTEX_STACK)  # 400 contends for the lock too
        s.futex(400, x + 0.27, 0.005, addr=lock, ustack=("__lll_lock_wait", "pthread_mutex_lock"))
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    shares = dict(zip(a.findings["category"], a.findings["share"]))
    assert a.findings.iloc[0].category == "input_pipeline"
    # The trainer's 250 ms wait: 10 ms of it overlap the feeder's lock wait.
    assert shares.get("lock_contention", 0.0) == pytest.approx(0.04, abs=0.015)
    assert shares["input_pipeline"] >= 0.9
    assert chain_of(a.findings.iloc[0]) == [(TRAINER, "futex"), (300, "futex"), (200, "running")]
    assert np.allclose(a.chain_ends.groupby("wait")["weight"].sum(), 1.0)
    # Each link's parent is the link one depth up on the same wait.
    linked = a.chains[a.chains["parent"] >= 0]
    parents = a.chains.iloc[linked["parent"].to_numpy()]
    assert (parents["depth"].to_numpy() == linked["depth"].to_numpy() - 1).all()
    assert (parents["wait"].to_numpy() == linked["wait"].to_numpy()).all()
