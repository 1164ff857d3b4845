"""The letters off-CPU rows carry for sched_switch's prev_state (tracer/collectors/sched.py
state_letters): the lowest set bit names the state; running and preempted are R."""

from __future__ import annotations

import numpy as np

from trainbpf.tracer.collectors.sched import STATE_PREEMPTED, state_letters


def test_each_state_bit_and_its_combinations():
    raw = np.array([0, STATE_PREEMPTED, 1, 2, 1 | 1024, 2 | 4, 128, 1024, 4, 8, 16, 32, 64, STATE_PREEMPTED | 1,
                    1 << 40], dtype=np.int64)
    assert state_letters(raw).tolist() == ["R", "R", "S", "D", "S", "D", "I", "?", "T", "t", "X", "Z", "P", "S",
                                           "?"]


def test_unsigned_and_empty_columns():
    assert state_letters(np.array([2, 0], dtype=np.uint32)).tolist() == ["D", "R"]
    assert state_letters(np.array([], dtype=np.uint32)).tolist() == []
