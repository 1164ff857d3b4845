"""The recorder's thread table (tracer/collector.py ThreadTable): which threads are live
as threads are added and exit, however they are added."""

from __future__ import annotations

from trainbpf.tracer.collector import ThreadTable


def test_live_follows_every_addition_and_exit():
    table = ThreadTable()
    table.tgid[10] = 10  # as the recorder seeds
    table.tgid.setdefault(11, 10)  # as the sched probe's fork events add
    assert table.live() == {10: 10, 11: 10}
    table.exit(11)
    assert table.live() == {10: 10}
    table.tgid.setdefault(12, 10)
    assert table.live() == {10: 10, 12: 10}
    table.exit(12)
    table.exit(12)  # told twice: once in the log
    table.tgid.setdefault(10, 99)  # a known thread is not re-added
    assert table.live() == {10: 10}
    assert table.exit_log == [11, 12] and table.unforgotten == [11, 12]


def test_live_is_not_rebuilt_while_nothing_changes():
    table = ThreadTable()
    for tid in range(1000, 5000):
        table.tgid[tid] = 1000
        table.exit(tid)
    table.tgid[1] = 1
    first = table.live()
    assert first == {1: 1}
    assert table.live() is first, "rebuilt with no thread added or gone"
    table.tgid[2] = 1
    assert table.live() == {1: 1, 2: 1} and table.live() is not first
