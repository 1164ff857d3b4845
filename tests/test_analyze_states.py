"""Thread states tile every observed ns; causes come from the kernel evidence; roles."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from synth import (
    FAULT_STACK, FUTEX_STACK, MUNMAP_STACK, RECLAIM_STACK, SLEEP_STACK, START_NS, TRAINER, Synth, d,
    healthy, input_pipeline,
)
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.pipeline import analyze, observed_ns
from trainbpf.analyzers.threads.states import STATE_COLUMNS, state_totals
from trainbpf.analyzers.vocab import STATE_DTYPE, STATES
from trainbpf.trace.errors import UsageError


def assert_tiles(analysis):
    """Per thread: sorted, contiguous, non-overlapping, and summing to observed time."""
    st = analysis.states
    assert (st["end_ns"] > st["start_ns"]).all()
    for tid, g in st.groupby("tid"):
        assert (g["start_ns"].to_numpy()[1:] == g["end_ns"].to_numpy()[:-1]).all(), tid
    totals = analysis.totals.groupby("tid")["ns"].sum()
    observed = observed_ns(analysis)
    for tid, ns in observed.items():
        assert totals.get(tid, 0) == ns, tid


def messy() -> Synth:
    s = Synth(duration_s=10.0)
    s.thread(TRAINER, "python")
    s.thread(101, "pt_data_worker", name="thread", ts=2.0, parent=TRAINER)
    s.exit(101, 8.0)
    s.offcpu(TRAINER, 1.0, 0.5, runq=0.1, waker=101)
    s.offcpu(TRAINER, 1.2, 0.5)  # overlaps the previous one (inconsistent input)
    s.offcpu(TRAINER, 3.0, 1.0, state="R", runq=0.2)  # preempted: all runnable
    s.offcpu(TRAINER, 9.5, 2.0)  # runs past the trace end
    s.offcpu(101, 1.0, 2.0)  # starts before the thread was created
    s.offcpu(101, 7.5, 1.0, state="D")  # ends after it exited
    s.offcpu_short(TRAINER, 5.0, dur=0.3, count=300, runq=0.1)
    s.offcpu_short(TRAINER, 6.0, dur=0.01, count=10, state="R", runq=0.0)
    s.offcpu_short(101, 5.0, dur=0.2, count=100, runq=0.05)
    s.oncpu(555, 4.0)  # a thread seen only in samples
    return s


def test_states_tile_observed_time(tmp_path):
    a = analyze(messy().read(tmp_path))
    assert_tiles(a)
    assert list(a.states.columns) == list(STATE_COLUMNS) + ["futex_class"]
    assert a.states["state"].dtype == STATE_DTYPE
    assert a.states["tid"].dtype == np.int32
    obs = observed_ns(a)
    assert obs[101] == d(6.0)  # created at 2 s, exited at 8 s
    assert obs[TRAINER] == d(10.0)
    assert obs[555] == d(6.0)  # from its first sample to the end


def test_state_values(tmp_path):
    a = analyze(messy().read(tmp_path))
    sec = {(r.tid, r.state): r.ns / 1e9 for r in a.totals.itertuples()}
    # Blocked 1.0-1.4 then runnable 1.4-1.5; the overlapping row adds 1.5-1.7 asleep.
    assert sec[(TRAINER, "sleep")] == pytest.approx(0.4 + 0.2 + 0.5)
    # runnable: 0.1 runq tail + 1.0 preempted + short waits' runnable 0.1 + 0.01 (R).
    assert sec[(TRAINER, "runnable")] == pytest.approx(0.1 + 1.0 + 0.1 + 0.01)
    assert sec[(TRAINER, "short_wait")] == pytest.approx(0.2)
    assert sec[(101, "uninterruptible")] == pytest.approx(0.5)


def test_window_clips_states(tmp_path):
    s = messy()
    s.rows["offcpu_short"] = []
    a = analyze(s.read(tmp_path), window=Window(1.25, 3.5))
    assert a.window.ns == d(2.25)
    assert_tiles(a)
    sec = {(r.tid, r.state): r.ns / 1e9 for r in a.totals.itertuples()}
    assert sec[(TRAINER, "sleep")] == pytest.approx(0.15 + 0.2)
    assert sec[(TRAINER, "runnable")] == pytest.approx(0.1 + 0.5)


def test_short_waits_never_exceed_the_gaps(tmp_path):
    s = Synth(duration_s=1.0)
    s.thread(TRAINER, "python")
    s.offcpu(TRAINER, 0.1, 0.8)
    s.offcpu_short(TRAINER, 1.0, dur=5.0, count=5000, runq=1.0)  # claims more than was running
    a = analyze(s.read(tmp_path))
    assert_tiles(a)
    sec = dict(zip(a.totals["state"].astype(str), a.totals["ns"] / 1e9))
    assert sec.get("running", 0.0) == pytest.approx(0.0, abs=1e-6)
    assert sec["short_wait"] + sec["runnable"] == pytest.approx(0.2)
    assert sec["runnable"] == pytest.approx(0.2 * 1.0 / 5.0, rel=1e-3)


def test_causes_from_evidence(tmp_path):
    s = Synth(duration_s=10.0)
    s.thread(TRAINER, "python")
    s.offcpu(TRAINER, 1.0, 0.1, kstack=FUTEX_STACK)  # futex by stack
    s.offcpu(TRAINER, 2.0, 0.1)
    s.futex(TRAINER, 1.99, 0.11, addr=0x10)  # futex by row
    s.offcpu(TRAINER, 3.0, 0.1, state="D")
    s.block_rq(TRAINER, 3.01, 0.05)  # D + block request
    s.offcpu(TRAINER, 4.0, 0.1, state="D", kstack=FAULT_STACK)
    s.offcpu(TRAINER, 5.0, 0.1, state="D", kstack=RECLAIM_STACK)  # reclaim inside a fault
    s.offcpu(TRAINER, 6.0, 0.1)
    s.futex(TRAINER, 6.0, 0.1, addr=0x20)
    s.reclaim(TRAINER, 5.95, 0.2)  # reclaim row beats the futex row
    s.offcpu(TRAINER, 7.0, 0.1, kstack=SLEEP_STACK)
    s.offcpu(TRAINER, 8.0, 0.1, state="T")
    s.offcpu(TRAINER, 9.0, 0.1, state="S")
    s.block_rq(TRAINER, 9.0, 0.1)  # a block request does not explain a sleep
    s.offcpu(TRAINER, 9.5, 0.1, state="D", kstack=MUNMAP_STACK)
    s.mmap_lock(TRAINER, 9.5, 0.1)
    a = analyze(s.read(tmp_path))
    st = a.states[(a.states["tid"] == TRAINER) & (a.states["state"] != "running")]
    got = dict(zip(((st["start_ns"] - START_NS) / 1e9).round(2), st["state"].astype(str)))
    assert got == {
        1.0: "futex", 2.0: "futex", 3.0: "block_io", 4.0: "page_faults", 5.0: "memory_reclaim",
        6.0: "memory_reclaim", 7.0: "sleep", 8.0: "other", 9.0: "sleep", 9.5: "mmap_lock",
    }


def test_state_totals_fixed_columns_when_empty():
    empty = pd.DataFrame({"tid": np.zeros(0, np.int32), "start_ns": np.zeros(0, np.int64), "end_ns": np.zeros(0, np.int64),
                          "state": pd.Categorical([], dtype=STATE_DTYPE)})
    totals = state_totals(empty)
    assert list(totals.columns) == ["tid", "state", "ns"]
    assert totals["ns"].dtype == np.int64


def test_roles(tmp_path):
    s = input_pipeline()
    s.thread(201, "pt_data_pin")
    s.thread(202, "ckpt_writer")
    s.thread(203, "pt_autograd_0")
    s.thread(204, "python")
    s.thread(205, "python")
    s.dirty_pause(205, 1.0, 0.1)
    a = analyze(s.read(tmp_path))
    roles = dict(zip(a.threads["tid"], a.threads["role"].astype(str)))
    assert roles == {TRAINER: "trainer", 200: "dataloader", 201: "pin_memory", 202: "checkpoint",
                     203: "autograd", 204: "other", 205: "checkpoint"}
    assert dict(zip(a.threads["tid"], a.threads["role_source"]))[205] == "behaviour"


def test_producer_role_from_behaviour(tmp_path):
    s = input_pipeline()
    s.rows["thread"] = [r for r in s.rows["thread"] if r["tid"] != 200]
    s.thread(200, "python3")
    a = analyze(s.read(tmp_path))
    row = a.threads.set_index("tid").loc[200]
    assert (row["role"], row["role_source"]) == ("dataloader", "behaviour")


def test_trainer_option_and_target(tmp_path):
    s = healthy()
    s.thread(300, "python")
    path = s.write(tmp_path / "t.parquet")
    from trainbpf.trace.reader import read_trace

    assert analyze(read_trace(path)).trainer_tid == TRAINER
    assert analyze(read_trace(path), trainer_tid=300).trainer_tid == 300
    with pytest.raises(UsageError, match="--trainer-tid 4242"):
        analyze(read_trace(path), trainer_tid=4242)


def test_trainer_without_target_pid(tmp_path):
    s = Synth(target_pid=None)
    s.thread(300, "python", pid=300)
    s.thread(301, "python", pid=300)
    assert analyze(s.read(tmp_path)).trainer_tid == 300


def test_states_column_order_matches_states_vocabulary():
    assert STATES[:2] == ("running", "runnable")
