"""The CPython frame walk end to end on real processes of each CPython version: the
recorder walks frames in BPF (probes/pyframes.h), names them from the processes' code
objects, and the analysis names both ends of the finding's chain.  A layout refused by
the self-test gives native stacks only and a note, never wrong names."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from tests.kernel_env import PYTHON_VERSIONS, python_interpreter, require_root
from tests.recording import record_workload
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report
from trainbpf.reports.text import render_text
from trainbpf.trace.reader import read_trace
from trainbpf.tracer.record import record
from trainbpf.tracer.record_config import RecordConfig
from trainbpf.tracer.settings import Settings
from trainbpf.tracer.symbols import pystacks, pyruntime

WORKLOAD = Path(__file__).with_name("pyframes_workload.py")
SECONDS = 4  # the forked worker is found at a flush (every second) after it starts
SETTINGS = Settings(python_frames=True)
PROBES = ["sched", "futex", "oncpu"]


def _lines() -> dict[str, int]:
    text = WORKLOAD.read_text().splitlines()
    return {m.group(1): i for i, line in enumerate(text, 1) if (m := re.search(r"# line: (\w+)$", line))}


LINES = _lines()


def _record(tmp_path: Path, version: str):
    require_root()
    return record_workload(tmp_path / f"py{version}.parquet", "", settings=SETTINGS,
                           command=[python_interpreter(version), str(WORKLOAD), str(SECONDS)],
                           probes=PROBES)


def _stacks(rec) -> dict[int, list[str]]:
    st = rec.trace.view("stack")
    py = st[st["space"] == "python"]
    return {int(i): f.split(";") for i, f in zip(py["stack_id"], py["frames"])}


def _frames_of(rec, kind: str, tid: int) -> list[list[str]]:
    rows = rec.trace.view(kind)
    stacks = _stacks(rec)
    ids = rows.loc[(rows["tid"] == tid) & rows["pystack_id"].notna(), "pystack_id"]
    return [stacks[int(i)] for i in ids if int(i) in stacks]


def _frame(function: str, line: str) -> str:
    return f"{function} ({WORKLOAD}:{LINES[line]})"


@pytest.fixture(scope="module", params=list(PYTHON_VERSIONS))
def recorded(request, tmp_path_factory):
    return request.param, _record(tmp_path_factory.mktemp("pyframes"), request.param)


@pytest.mark.kernel
def test_stacks_name_the_functions_and_lines(recorded):
    version, rec = recorded
    meta = rec.trace.meta["python_frames"]
    tids = rec.tids
    statuses = {int(pid): p for pid, p in meta["processes"].items()}
    assert statuses[rec.pid] == {"version": version, "status": "ok"}
    assert statuses[tids["worker"]] == {"version": version, "status": "ok"}
    # The trainer blocked with the GIL released in Queue.get, called at the marked line.
    trainer = _frames_of(rec, "offcpu", tids["trainer"])
    assert any(_frame("Trainer.train_step" if version != "3.10" else "train_step", "wait") in s for s in trainer)
    # The loader: blocked in os.read (GIL released), and on-CPU decoding.
    loader_off = _frames_of(rec, "offcpu", tids["loader"])
    assert any(s[0] == _frame("decode_batch", "read") for s in loader_off)
    loader_on = _frames_of(rec, "oncpu", tids["loader"])
    assert any(s[0] == _frame("decode_batch", "decode") and s[1].startswith("loader_main (") for s in loader_on)
    # The forked worker process, born while recording.
    worker_on = _frames_of(rec, "oncpu", tids["worker"])
    assert any(s[0] == _frame("produce_sample", "produce") for s in worker_on)
    # Nothing outside the workload's own functions is named at a workload line.
    names = {f for s in _stacks(rec).values() for f in s if str(WORKLOAD) in f}
    known = {_frame(fn, ln) for fn, ln in (("produce_sample", "produce"), ("decode_batch", "read"),
                                           ("decode_batch", "decode"))}
    assert names & known == known


@pytest.mark.kernel
def test_finding_names_both_ends(recorded):
    version, rec = recorded
    analysis = analyze(rec.trace)
    text = render_text(Report.of(analysis))
    top = analysis.findings.iloc[0]
    assert top.category == "input_pipeline", analysis.findings[["category", "seconds"]]
    frames = top.evidence["python_frames"]
    waiter = [f["function"] for f in frames["waiter"]]
    producer = [(f["function"], f["line"]) for f in frames["producer"]]
    assert ("Trainer.train_step" if version != "3.10" else "train_step") in waiter
    assert ("decode_batch", LINES["decode"]) in producer or ("produce_sample", LINES["produce"]) in producer
    assert "    python: trainer" in text


@pytest.mark.kernel
def test_refused_layout_gives_native_stacks_and_a_note(tmp_path, monkeypatch):
    """A skewed offset (the table of another build) fails the self-test: the process
    keeps native stacks, and the report says why."""
    monkeypatch.setattr(pystacks.pyruntime, "attach",
                        functools.partial(pyruntime.attach, corrupt="code.qualname"))
    rec = _record(tmp_path, "3.12")
    statuses = rec.trace.meta["python_frames"]["processes"]
    status = statuses[str(rec.pid)]
    assert status["version"] == "3.12" and status["status"].startswith("CPython 3.12: ") and status["status"] != "ok"
    assert not _stacks(rec)
    assert rec.trace.view("offcpu")["pystack_id"].isna().all()
    assert rec.trace.view("offcpu")["ustack_id"].ge(0).any()
    text = render_text(Report.of(analyze(rec.trace)))
    assert f"NOTE: Python frames were not walked in process {rec.pid}" in text


BLOCKED = '''import threading, time
stop = threading.Event()
def wait_for_shutdown():
    stop.wait()
t = threading.Thread(target=wait_for_shutdown); t.start()
print(t.native_id, flush=True)
while True:
    time.sleep(0.02)
'''


@pytest.mark.kernel
@pytest.mark.parametrize("version", ["3.10", "3.13"])
def test_thread_blocked_to_the_end_is_named(tmp_path, version):
    """A thread blocked (GIL released) for the whole recording has no switch-in, so the
    kernel never took its stacks: its Python stack is read at the stop."""
    require_root()
    proc = subprocess.Popen([python_interpreter(version), "-c", BLOCKED], stdout=subprocess.PIPE, text=True)
    try:
        blocked = int(proc.stdout.readline())
        out = tmp_path / "blocked.parquet"
        record(config=RecordConfig(pid=proc.pid, output=out, duration=2.5, settings=SETTINGS, probes=PROBES,
                                   gpu="off"), handle_signals=False)
        trace = read_trace(out)
    finally:
        proc.kill()
        proc.wait()
    rows = trace.view("offcpu")
    still = rows[(rows["tid"] == blocked) & (rows["cpu"] == -1)]
    assert len(still) == 1 and not pd.isna(still["pystack_id"].iloc[0])
    stacks = {int(i): f.split(";") for i, f in zip(*(trace.view("stack")[c] for c in ("stack_id", "frames")))}
    frames = stacks[int(still["pystack_id"].iloc[0])]
    assert frames[0].startswith(("Condition.wait (", "wait (")), frames  # in threading.py
    assert "wait_for_shutdown (<string>:4)" in frames, frames
