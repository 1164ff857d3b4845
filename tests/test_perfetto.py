"""The Chrome trace-event export that ui.perfetto.dev opens."""

from __future__ import annotations

import json
import stat
from collections import defaultdict

import pytest

from synth import TRAINER, WORKER, Synth, input_pipeline
from trainbpf.reports.perfetto import GPU_PID, run_export
from trainbpf.trace.errors import OutputError


def export(tmp_path, synth: Synth) -> list[dict]:
    out = run_export(path=synth.write(tmp_path / "t.parquet"), output=tmp_path / "t.json")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    doc = json.loads(out.read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit"}
    return doc["traceEvents"]


def test_export_tracks_counters_and_flows(tmp_path):
    events = export(tmp_path, input_pipeline())
    by_ph = defaultdict(list)
    for e in events:
        assert e["ph"] in {"M", "X", "C", "s", "f"}
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int)
        by_ph[e["ph"]].append(e)

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in by_ph["M"] if e["name"] == "thread_name"}
    assert names[(TRAINER, TRAINER)] == "python [trainer]"
    assert names[(WORKER, WORKER)] == "pt_data_worker [dataloader]"

    # Thread states: X slices in microseconds that tile each thread's 10 s.
    per_thread = defaultdict(float)
    slices = defaultdict(list)
    for e in by_ph["X"]:
        assert e["dur"] >= 0 and e["ts"] >= 0
        if e["cat"] == "state":
            per_thread[e["tid"]] += e["dur"]
            slices[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    assert per_thread[TRAINER] == pytest.approx(10e6)
    assert per_thread[WORKER] == pytest.approx(10e6)
    assert {name for _, _, name in slices[TRAINER]} == {"running", "futex", "runnable"}
    starved = [e for e in by_ph["X"] if e["cat"] == "starved"]
    assert {e["name"] for e in starved} == {"input_pipeline", "cpu_contention", "host_compute"}
    assert all(e["pid"] == GPU_PID for e in starved)

    # GPU utilisation counter.
    assert len(by_ph["C"]) == 100
    assert all(0 <= e["args"]["util"] <= 100 and e["pid"] == GPU_PID for e in by_ph["C"])

    # Wake-ups: one flow per trainer wait, from the worker's running slice to the trainer.
    starts = {e["id"]: e for e in by_ph["s"]}
    finishes = {e["id"]: e for e in by_ph["f"]}
    assert len(starts) == len(finishes) == 50
    for fid, s in starts.items():
        f = finishes[fid]
        assert (s["tid"], f["tid"]) == (WORKER, TRAINER)
        assert s["ts"] == f["ts"] and f["bp"] == "e"
        assert s["name"] == f["name"] and s["cat"] == f["cat"]
        assert any(a <= s["ts"] <= b and name == "running" for a, b, name in slices[WORKER])
        assert any(a <= f["ts"] < b for a, b, _ in slices[TRAINER])


def test_export_empty_trace(tmp_path):
    events = export(tmp_path, Synth(duration_s=2.0))
    assert {e["ph"] for e in events} == {"M"}


def test_export_unwritable_output(tmp_path):
    path = input_pipeline().write(tmp_path / "t.parquet")
    with pytest.raises(OutputError):
        run_export(path=path, output=tmp_path / "missing-dir" / "t.json")
