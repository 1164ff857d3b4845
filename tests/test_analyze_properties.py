"""Property tests: random schema-valid event tables never crash the analyzers, shares
stay fractions that sum to at most 1, and every thread's states add up to its observed
time (also inside a random window)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from report_contract import validate_report
from trainbpf.analyzers.causes.categories import CATEGORIES
from trainbpf.analyzers.findings.ranking import MIN_FINDING_NS
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.pipeline import analyze, observed_ns
from trainbpf.reports.document import Report, build_report
from trainbpf.reports.text import render_text
from trainbpf.trace.reader import Trace
from trainbpf.trace.schema import SCHEMA_ID, TRACE_SCHEMA
from trainbpf.trace.spool import stored_batch

START = 1_000_000_000_000
SPAN = 2_000_000_000  # 2 s
TIDS = [100, 101, 102, 103]
STACKS = {1: ("kernel", "schedule;futex_wait;do_futex"), 2: ("kernel", "io_schedule;folio_wait_bit;handle_mm_fault"),
          3: ("kernel", "shrink_node;try_to_free_pages"), 4: ("user", "take_gil;PyEval_RestoreThread"),
          5: ("user", "__lll_lock_wait;pthread_mutex_lock;malloc"), 6: ("kernel", "balance_dirty_pages;vfs_write")}

ts = st.integers(START - SPAN // 10, START + SPAN + SPAN // 10)
dur = st.integers(0, SPAN // 2)
tid = st.sampled_from(TIDS)
maybe_tid = st.one_of(st.none(), st.sampled_from(TIDS + [999]))
stack = st.one_of(st.none(), st.sampled_from(list(STACKS)))
letter = st.sampled_from(["S", "D", "R", "I", "T", "X", "?"])


def rows(**fields):
    return st.lists(st.fixed_dictionaries(fields), max_size=25)


TABLES = st.fixed_dictionaries({
    "thread": rows(ts_ns=ts, tid=tid, pid=st.sampled_from([100, 101]), comm=st.sampled_from(["python", "pt_data_worker", "ckpt", ""]),
                   name=st.sampled_from(["seed", "thread", "process", "exec", "rename"])),
    "exit": rows(ts_ns=ts, tid=tid, pid=st.just(100)),
    "offcpu": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), state=letter, runq_ns=dur, peer_tid=maybe_tid,
                   kstack_id=stack, ustack_id=stack),
    "offcpu_short": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), state=letter, count=st.integers(0, 100), runq_ns=dur),
    "oncpu": rows(ts_ns=ts, tid=tid, pid=st.just(100), cpu=st.integers(0, 3), kstack_id=stack),
    "futex": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), addr=st.sampled_from([16, 32, 48]), op=st.just(137), ustack_id=stack),
    "mmap_lock": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), state=st.sampled_from(["read", "write"]), count=st.just(1)),
    "reclaim": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), state=st.just("direct"), count=st.integers(0, 99)),
    "dirty_pause": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), count=st.integers(0, 9), size=st.integers(0, 9), name=st.just("sda")),
    "block_rq": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), size=st.integers(0, 1 << 20), name=st.just("R"), op=st.just(8), addr=st.just(0)),
    "mm_syscall": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), name=st.sampled_from(["mmap", "munmap", "brk"]),
                       addr=st.just(0), size=st.integers(0, 1 << 22), op=st.just(0), count=st.just(0)),
    "faults": rows(ts_ns=ts, dur_ns=dur, tid=tid, pid=st.just(100), count=st.integers(0, 1000)),
    "numa_move": rows(ts_ns=ts, tid=tid, pid=st.just(100), cpu=st.integers(0, 3), op=st.integers(0, 1), node=st.integers(0, 1), name=st.just("move")),
    "gpu": rows(ts_ns=ts, op=st.integers(0, 1), value=st.floats(0, 100), count=st.just(1), size=st.just(1), name=st.just("GPU-0")),
})


def build_trace(tables: dict, with_clock: bool, trainer: int | None) -> Trace:
    batches = [stored_batch(kind, {k: [r[k] for r in rs] for k in rs[0]}) for kind, rs in tables.items() if rs]
    batches.append(stored_batch("stack", {
        "ts_ns": [START] * len(STACKS), "kstack_id": list(STACKS), "state": [k for k, _ in STACKS.values()],
        "pid": [100] * len(STACKS), "name": [f for _, f in STACKS.values()],
    }))
    meta = {
        "schema": SCHEMA_ID, "target_pid": 100, "trainer_tid": trainer,
        "topology": {"nodes": {"0": [0, 1], "1": [2, 3]}, "gpu_node": 0, "declared": True},
    }
    if with_clock:
        meta["clock"] = {"start_mono_ns": START, "end_mono_ns": START + SPAN}
    return Trace(path=Path("random.parquet"), meta=meta, table=pa.Table.from_batches(batches, schema=TRACE_SCHEMA))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    tables=TABLES,
    with_clock=st.booleans(),
    trainer=st.one_of(st.none(), st.sampled_from(TIDS)),
    window=st.one_of(st.none(), st.builds(Window, st.floats(0, 0.9), st.floats(1.0, 3.0))),
)
def test_random_tables(tables, with_clock, trainer, window):
    trace = build_trace(tables, with_clock, trainer)
    if window is not None and not with_clock:
        window = None  # the span then depends on the rows; keep the window valid
    a = analyze(trace, window=window)

    shares = a.findings["share"].to_numpy()
    assert ((shares >= 0) & (shares <= 1)).all()
    assert shares.sum() <= 1.0 + 1e-9
    # Findings explain the starved time, less categories too small to report (< 1 ms each).
    explained = a.findings["seconds"].sum() * 1e9
    assert explained <= a.starved_ns * (1 + 1e-9) + 1e-3
    assert explained >= a.starved_ns - len(CATEGORIES) * MIN_FINDING_NS - 1e-3

    totals = a.totals.groupby("tid")["ns"].sum()
    for t, ns in observed_ns(a).items():
        assert totals.get(t, 0) == ns, (t, totals.get(t, 0), ns)
    assert (a.states["end_ns"] > a.states["start_ns"]).all()
    assert (a.starved["ns"] >= 0).all()
    assert a.starved["end_ns"].le(a.window.end_ns).all() and a.starved["start_ns"].ge(a.window.start_ns).all()

    report = build_report(a)
    validate_report(report)
    assert render_text(Report(a, report))
