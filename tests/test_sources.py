"""One source protocol (tracer/source.py): a source added to tracer/sources.SOURCES runs
through every phase of a real recording and its rows and metadata reach the trace, with
no change to the session loop, which names no source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np

from kernel_env import require_root
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import make_batch

RECORD_PY = Path(__file__).resolve().parents[1] / "tracer" / "record.py"


def _marker(ts_ns: int, what: str):
    return make_batch("lost", {"ts_ns": np.array([ts_ns], dtype=np.int64), "probe": [what],
                               "lost": np.array([1], dtype=np.int64)})


def test_a_source_in_the_list_records_rows_and_metadata(tmp_path, monkeypatch):
    require_root()
    from trainbpf.tracer import sources
    from trainbpf.tracer.record import record
    from trainbpf.tracer.record_config import RecordConfig
    from trainbpf.tracer.source import Source

    class Marker(Source):
        name = "marker"
        opened_with_probes: list[str] = []

        def open(self, session) -> None:
            super().open(session)
            Marker.opened_with_probes = [p.name for p in session.probes]

        def seed(self, walked):
            return [_marker(self.session.start_ns, f"seeded {len(walked)}")]

        def flush(self, now_ns, *, final):
            return [_marker(now_ns, "final flush")] if final else []

        def end(self, now_ns, ended, *, final):
            return ended + [_marker(now_ns, "stop")] if final else ended

        def meta(self):
            return {"marker": {"closing": True}}

    monkeypatch.setattr(sources, "SOURCES", [*sources.SOURCES, Marker])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        record(config=RecordConfig(pid=sleeper.pid, output=tmp_path / "t.parquet", duration=1.5,
                                   probes=("sched",), gpu="off"), handle_signals=False)
    finally:
        sleeper.kill()
        sleeper.wait()
    trace = read_trace(tmp_path / "t.parquet")
    names = list(trace.view("lost")["probe"])
    assert "seeded 1" in names and "final flush" in names and "stop" in names, names
    assert trace.meta["marker"] == {"closing": True}
    assert Marker.opened_with_probes == ["sched"]


def _source_names() -> set[str]:
    from trainbpf.tracer import loader

    names = {c.name for c in loader.ALL_COLLECTORS}
    try:
        from trainbpf.tracer import sources
    except ImportError:  # before the one protocol: the probes' names alone
        return names
    return names | {s.name for s in sources.SOURCES}


def test_the_session_loop_names_no_source():
    """record.py compares no string with a source's name (`c.name == "futex"`): what a
    source needs from another comes through the session, not the loop."""
    names = _source_names()
    named = []
    for node in ast.walk(ast.parse(RECORD_PY.read_text())):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                for const in ast.walk(operand):
                    if isinstance(const, ast.Constant) and const.value in names:
                        named.append(f"line {node.lineno}: {const.value!r}")
    assert not named, f"record.py tests sources by name: {named}"
