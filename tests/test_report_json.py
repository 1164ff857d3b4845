"""`analyze --format json`: exactly the contract (docs/design.md §Trace contract), for every kind of trace."""

from __future__ import annotations

import json
import stat

import pytest

from report_contract import validate_report
from synth import TRAINER, WORKER, Synth, healthy, input_pipeline
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import build_report
from trainbpf.reports.render import run_analyze


def empty() -> Synth:
    return Synth(duration_s=5.0)


def no_clock_no_rows() -> Synth:
    return Synth(clock=False, gpu_source=None, target_pid=None)


def lossy() -> Synth:
    s = input_pipeline(lost={"sched": 1234, "futex": 5})
    return s


SCENARIOS = {
    "input_pipeline": input_pipeline,
    "healthy": healthy,
    "healthy_no_gpu": lambda: healthy(gpu=False),
    "empty": empty,
    "no_clock_no_rows": no_clock_no_rows,
    "lossy": lossy,
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_json_matches_contract(tmp_path, name):
    path = SCENARIOS[name]().write(tmp_path / "t.parquet")
    out = tmp_path / "report.json"
    text = run_analyze(path=path, fmt="json", output=out)
    doc = json.loads(out.read_text())
    assert json.loads(text) == doc
    validate_report(doc)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_json_values_input_pipeline(tmp_path):
    doc = json.loads(run_analyze(path=input_pipeline().write(tmp_path / "t.parquet"), fmt="json"))
    assert doc["trace"]["duration_s"] == 10.0
    assert doc["trace"]["pid"] == TRAINER
    # The GPU is busy 95% of the time the trainer runs: 60 of every 200 ms.
    assert doc["gpu"] == {"source": "nvidia-smi", "samples": 100, "idle_fraction": 0.715}
    # Its 140 ms waits fall where the GPU idles: each sample's idle covers its stall; the
    # GPU's 3 ms idle in each 60 ms the trainer runs is its own host work.
    assert doc["starved_s"] == pytest.approx(7.15)
    assert doc["host_bound_s"] == pytest.approx(0.15)
    top = doc["findings"][0]
    assert top["category"] == "input_pipeline"
    assert top["severity"] == "critical"
    assert top["chain"] == [
        {"tid": TRAINER, "role": "trainer", "state": "futex"},
        {"tid": WORKER, "role": "dataloader", "state": "running"},
    ]
    trainer = doc["threads"][0]
    assert (trainer["tid"], trainer["role"]) == (TRAINER, "trainer")
    assert sum(trainer["seconds"].values()) == pytest.approx(10.0)
    assert sum(f["seconds"] for f in doc["findings"]) == pytest.approx(doc["starved_s"])


def test_json_lost_events_and_no_gpu(tmp_path):
    doc = json.loads(run_analyze(path=lossy().write(tmp_path / "t.parquet"), fmt="json"))
    assert doc["trace"]["lost_events"] == 1239
    doc = json.loads(run_analyze(path=healthy(gpu=False).write(tmp_path / "u.parquet"), fmt="json"))
    assert doc["gpu"] == {"source": None, "samples": 0, "idle_fraction": None}


def test_json_empty_trace(tmp_path):
    doc = json.loads(run_analyze(path=empty().write(tmp_path / "t.parquet"), fmt="json"))
    assert doc["findings"] == [] and doc["threads"] == []
    assert doc["starved_s"] == 0.0
    assert doc["trace"]["duration_s"] == 5.0


def test_shares_never_sum_above_one_after_rounding(tmp_path):
    """Three categories of exactly a third each: rounded shares still sum to <= 1."""
    s = Synth(duration_s=9.0)
    s.thread(TRAINER, "python")
    for i, x in enumerate(range(0, 9)):
        kind = i % 3
        if kind == 0:
            s.offcpu(TRAINER, x + 0.5, 0.5, state="R", runq=0.5)
        elif kind == 1:
            s.offcpu(TRAINER, x + 0.5, 0.5, state="D")
            s.block_rq(TRAINER, x + 0.5, 0.5)
        else:
            s.offcpu(TRAINER, x + 0.5, 0.5, state="D")
            s.dirty_pause(TRAINER, x + 0.5, 0.5)
    report = build_report(analyze(s.read(tmp_path)))
    validate_report(report)
    assert [f["share"] for f in report["findings"]] == [0.333333] * 3
