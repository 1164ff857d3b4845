"""analyzers.roles on synthetic thread tables: who the trainer is."""

from __future__ import annotations

import pandas as pd

from trainbpf.analyzers.threads.roles import pick_trainer

S = 1_000_000_000


def _threads(*rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["tid", "pid", "comm", "first_ns", "last_ns"])


def test_a_main_thread_that_exited_hands_the_trainer_role_to_the_thread_that_carries_on():
    """Issue 34 item 8: the main thread left with pthread_exit at 1 s; of the threads
    observed after it, a data loader (named so) is left out; the step loop is the one
    observed longest after the exit."""
    threads = _threads((100, 100, "python", 0, 1 * S), (101, 100, "pt_data_worker", 0, 10 * S),
                       (102, 100, "python", 0, 10 * S), (103, 100, "python", 0, 2 * S),
                       (200, 200, "other", 0, 10 * S))
    assert pick_trainer(threads, target_pid=100, trainer_tid=None) == 102
    assert pick_trainer(threads, target_pid=100, trainer_tid=100) == 100  # named: kept
    alive = threads.assign(last_ns=10 * S)
    assert pick_trainer(alive, target_pid=100, trainer_tid=None) == 100  # never exited
    alone = threads[threads.tid.isin([100, 101])]
    assert pick_trainer(alone, target_pid=100, trainer_tid=None) == 101  # only a named one carries on


def test_threads_ending_with_their_process_leave_the_main_thread_the_trainer():
    """A process that exits (exit_group) ends every thread within milliseconds, the main
    thread's exit sometimes first: that is no pthread_exit, and the main thread stays the
    trainer (the loader ended 2 ms after it)."""
    threads = _threads((100, 100, "python", 0, 5 * S), (101, 100, "python", 0, 5 * S + 2_000_000))
    assert pick_trainer(threads, target_pid=100, trainer_tid=None) == 100
