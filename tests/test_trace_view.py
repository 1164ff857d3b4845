"""Meaningful column names per kind (Trace.view, schema.KIND_NAMES) and the category
registry (analyzers/causes/categories.py): one record per category, every other table derived."""

from __future__ import annotations

from pathlib import Path

import pytest

from synth import Synth, d, t
from trainbpf.analyzers.causes.categories import (
    BY_NAME,
    CATEGORIES,
    CHECK_CATEGORY,
    FUTEX_CATEGORY,
    REGISTRY,
    RUN_CATEGORY,
    STATE_CATEGORY,
)
from trainbpf.analyzers.vocab import RUN_CLASSES, STATES
from trainbpf.trace.schema import (
    KIND_COLUMNS,
    KIND_NAMES,
    named_frame,
    storage_column,
    view_columns,
)


def test_kind_names_rename_only_a_kinds_own_columns_to_distinct_names():
    for kind, names in KIND_NAMES.items():
        assert set(names) <= set(KIND_COLUMNS[kind]), kind
        assert len(set(view_columns(kind))) == len(KIND_COLUMNS[kind]), kind
        for stored, name in names.items():
            assert storage_column(kind, name) == stored


def test_view_is_the_frame_under_meaningful_names(tmp_path):
    s = Synth()
    s.thread(100, "python")
    s.add("dirty_pause", ts_ns=t(1.0), dur_ns=d(0.01), tid=100, pid=100, count=700, size=512, name="sda")
    s.gpu_series(lambda ts: 40.0, index=1)
    trace = s.read(tmp_path)
    dirty = trace.view("dirty_pause")
    assert list(dirty.columns) == list(view_columns("dirty_pause"))
    assert (dirty["dirty_pages"].tolist(), dirty["limit_pages"].tolist(), dirty["device"].tolist()) == ([700], [512], ["sda"])
    gpu, stored = trace.view("gpu"), trace.frame("gpu")
    assert set(gpu["index"]) == {1} and gpu["util_pct"].tolist() == stored["value"].tolist()
    assert list(trace.view("gpu", ["ts_ns", "util_pct"]).columns) == ["ts_ns", "util_pct"]
    assert list(trace.frame("gpu").columns) == list(KIND_COLUMNS["gpu"])  # storage names unchanged
    # A reader takes either form: renaming twice changes nothing.
    assert named_frame("gpu", gpu).equals(gpu)
    assert named_frame("gpu", stored).equals(gpu)
    with pytest.raises(ValueError):
        trace.view("gpu", ["op_count"])


def test_every_state_class_and_check_has_one_category():
    assert CATEGORIES == tuple(c.name for c in REGISTRY) and len(set(CATEGORIES)) == len(CATEGORIES)
    assert set(STATE_CATEGORY) == set(STATES) - {"running"}
    assert set(RUN_CATEGORY) == set(RUN_CLASSES) and RUN_CATEGORY["user"] == "input_pipeline"
    assert FUTEX_CATEGORY == {"lock": "lock_contention", "gil": "gil_contention"}
    # The node checks of `trainbpf health`, by the category each points at.
    by_category = {}
    for check, category in CHECK_CATEGORY.items():
        by_category.setdefault(category, set()).add(check)
    assert by_category == {"cpu_contention": {"runqueue_latency_p99_seconds", "cpu_pressure_ratio"},
                           "memory_reclaim": {"reclaim_ratio", "memory_pressure_ratio"},
                           "dirty_throttling": {"dirty_throttle_ratio"}, "block_io": {"io_pressure_ratio"},
                           "numa_remote": {"numa_remote_ratio"}}
    assert [c.name for c in REGISTRY if not c.critical] == ["other"]
    for c in REGISTRY:
        assert c.summary.format(s=1.0, who="trainer python (1)", where="x.py:1 f") and c.recommendation and c.colour.startswith("#")
        assert callable(c.evidence)
    assert BY_NAME["numa_remote"].unmeasured


def test_a_version_1_trace_reads_the_python_stack_columns_as_null():
    """tests/data/small-trace.parquet predates the Python stack columns (schema v1)."""
    import pyarrow.parquet as pq

    from trainbpf.trace.reader import read_trace
    from trainbpf.trace.schema import V2_COLUMNS

    path = Path(__file__).with_name("data") / "small-trace.parquet"
    assert not set(V2_COLUMNS) & set(pq.read_schema(path).names)
    trace = read_trace(path)
    assert trace.meta["schema"] == "trainbpf.trace/1"
    offcpu = trace.frame("offcpu")
    assert len(offcpu) > 0
    assert offcpu["pystack_id"].isna().all() and offcpu["peer_pystack_id"].isna().all()
    assert trace.table["pystack_id"].null_count == trace.num_rows
