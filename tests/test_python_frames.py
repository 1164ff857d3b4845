"""Python frames in the analysis and the reports (synthetic traces with known frames at
both ends of a wake-up chain): the merged stack order, the finding's evidence
`python_frames`, its text line, the HTML and the Perfetto args; classification on
native frames only; and a trace without Python stacks exactly as before."""

from __future__ import annotations

import json

import pytest

from report_contract import validate_report
from synth import DIRTY_STACK, FAULT_STACK, FUTEX_STACK, SLEEP_STACK, TRAINER, WORKER, Synth, input_pipeline, periodic
from trainbpf.analyzers.causes.stack_reading import merge_frames, python_frame
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, render_json
from trainbpf.reports.html import render_html
from trainbpf.reports.perfetto import trace_events
from trainbpf.reports.python_frames import python_line, shown_frame
from trainbpf.reports.render import run_analyze
from trainbpf.reports.text import render_text
from trainbpf.trace.reader import read_trace

# The trainer blocks in next(loader) -> Queue.get at train.py:54; the worker decodes in
# data.py:31 and hands the batch over with Queue.put.
TRAINER_PY = (
    "wait (/usr/lib/python3.12/threading.py:331)",
    "get (/usr/lib/python3.12/queue.py:171)",
    "train_step (/srv/job/train.py:54)",
    "main (/srv/job/train.py:80)",
    "<module> (/srv/job/train.py:84)",
)
DECODE_PY = (
    "decode_batch (/srv/job/data.py:31)",
    "__getitem__ (/srv/job/data.py:12)",
    "_worker_loop (/opt/venv/lib/python3.12/site-packages/torch/utils/data/_utils/worker.py:308)",
)
PUT_PY = (
    "put (/usr/lib/python3.12/queue.py:152)",
    "_worker_loop (/opt/venv/lib/python3.12/site-packages/torch/utils/data/_utils/worker.py:320)",
)
TRAINER_USTACK = (
    "__futex_abstimed_wait_common", "pthread_cond_timedwait", "PyThread_acquire_lock_timed", "lock_PyThread_acquire_lock",
    "_PyEval_EvalFrameDefault", "PyEval_EvalCode", "run_mod", "Py_RunMain", "main",
)
EXPECTED_LINE = f"trainer {TRAINER}: train.py:54 train_step ← dataloader {WORKER}: data.py:31 decode_batch"


def frames_of(stack):
    return [python_frame(f) for f in stack]


def python_pipeline(*, decode_samples: bool = True) -> Synth:
    """input_pipeline with Python stacks: the trainer's at each wait, the worker's on-CPU
    samples while it decodes and its stack at each wake-up."""
    s = Synth(10.0)
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    for x in periodic(0.0, 10.0, 0.2):
        s.offcpu(TRAINER, x + 0.05, 0.14, waker=WORKER, runq=0.001, kstack=FUTEX_STACK, ustack=TRAINER_USTACK,
                 pystack=TRAINER_PY, waker_pystack=PUT_PY)
        s.futex(TRAINER, x + 0.05, 0.139, addr=0x7F00_0000_1000, ustack=TRAINER_USTACK, pystack=TRAINER_PY)
    if decode_samples:
        s.oncpu_every(WORKER, 0.0, 10.0, hz=99, pystack=DECODE_PY)
    s.gpu_from_running(TRAINER)
    return s


def test_merged_stack_reads_native_leaf_then_python_then_native_root():
    python = ["train_step (/srv/job/train.py:54)", "main (/srv/job/train.py:80)"]
    merged = merge_frames(list(TRAINER_USTACK), python)
    assert merged == [
        "__futex_abstimed_wait_common", "pthread_cond_timedwait", "PyThread_acquire_lock_timed",
        "lock_PyThread_acquire_lock", *python, "_PyEval_EvalFrameDefault", "PyEval_EvalCode", "run_mod", "Py_RunMain",
        "main",
    ]
    # A native walk that never reached the interpreter: the Python frames are its callers.
    assert merge_frames(["take_gil", "PyEval_RestoreThread"], python) == ["take_gil", "PyEval_RestoreThread", *python]
    assert merge_frames(list(TRAINER_USTACK), []) == list(TRAINER_USTACK)
    # 3.10's entry point is PyEval_EvalFrame*: the same cut.
    assert merge_frames(["select", "PyEval_EvalFrameEx", "main"], python) == ["select", *python, "PyEval_EvalFrameEx", "main"]


def test_python_frame_text():
    assert python_frame("Loader.__next__ (/srv/a (copy)/loader.py:7)") == {
        "function": "Loader.__next__", "file": "/srv/a (copy)/loader.py", "line": 7}
    assert python_frame("<module> (<frozen runpy>:88)") == {"function": "<module>", "file": "<frozen runpy>", "line": 88}
    assert python_frame("oddly written") == {"function": "oddly written", "file": "", "line": 0}


def test_finding_names_the_waiter_and_the_producer(tmp_path):
    a = analyze(python_pipeline().read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "input_pipeline"
    assert [c["tid"] for c in f.chain] == [TRAINER, WORKER]
    # The producer's on-CPU samples inside the waits (decode), not its hand-over (put).
    assert f.evidence["python_frames"] == {"waiter": frames_of(TRAINER_PY), "producer": frames_of(DECODE_PY)}
    # Python frames change no number.
    plain = analyze(input_pipeline().read(tmp_path, "plain.parquet")).findings.iloc[0]
    assert (f.share, f.seconds, f.chain) == (plain.share, plain.seconds, plain.chain)


def test_producer_falls_back_to_its_stack_at_the_wake_up(tmp_path):
    """No on-CPU sample of the worker has a Python stack: its stack when it woke the trainer."""
    f = analyze(python_pipeline(decode_samples=False).read(tmp_path)).findings.iloc[0]
    assert f.evidence["python_frames"]["producer"] == frames_of(PUT_PY)
    assert f.evidence["python_frames"]["waiter"] == frames_of(TRAINER_PY)


def test_reports_show_the_frames(tmp_path):
    path = python_pipeline().write(tmp_path / "t.parquet")
    report = Report.of(analyze(read_trace(path)))
    doc = json.loads(render_json(report))
    validate_report(doc)
    assert doc["schema"] == "trainbpf.report/3"
    frames = doc["findings"][0]["evidence"]["python_frames"]
    assert frames["waiter"][2] == {"function": "train_step", "file": "/srv/job/train.py", "line": 54}
    assert frames["producer"][0] == {"function": "decode_batch", "file": "/srv/job/data.py", "line": 31}
    assert python_line(doc["findings"][0]) == EXPECTED_LINE

    text = render_text(report)
    assert f"    python: {EXPECTED_LINE}\n" in text
    html = render_html(report)
    assert f"<b>Python:</b> {EXPECTED_LINE}</p>" in html
    assert "/srv/job/data.py" in html  # the evidence table's frames

    assert json.loads(run_analyze(path=path, fmt="json")) == doc


def test_perfetto_slices_carry_python_stacks(tmp_path):
    a = analyze(python_pipeline().read(tmp_path))
    events = json.loads("[" + ",".join(trace_events(a)) + "]")
    # Each wait's blocked part and its runnable tail: the stack it resumed at.
    waits = [e for e in events if e["ph"] == "X" and e["tid"] == TRAINER and e.get("args")]
    assert sorted(e["name"] for e in waits) == ["futex"] * 50 + ["runnable"] * 50
    assert all(e["args"] == {"python": list(TRAINER_PY), "waker_python": list(PUT_PY)} for e in waits)
    assert not [e for e in events if e["ph"] == "X" and e["tid"] == TRAINER and e["name"] == "running" and "args" in e]
    # Slices without a Python stack carry no args, as before.
    assert all("args" not in e for e in events if e["ph"] == "X" and e["tid"] == WORKER)


def test_lock_evidence_stack_merges_python_frames(tmp_path):
    """A lock waited on from Python: the evidence's user stack is the native leaf, then
    the Python frames; only the native frames could say it is the allocator's."""
    python = ("free_list_refill (/srv/job/buffers.py:20)", "malloc_pool (/srv/job/buffers.py:9)")
    leaf = ("__lll_lock_wait", "pthread_mutex_lock", "PyThread_acquire_lock")
    native = leaf + ("_PyEval_EvalFrameDefault", "Py_RunMain")
    s = Synth()
    tids = (TRAINER, 101, 102)
    for tid in tids:
        s.thread(tid, "python")
    k = 0
    while (k + 3) * 0.1 < s.duration_s:
        holder, waker = tids[k % 3], tids[(k + 2) % 3]
        s.offcpu(holder, (k + 1) * 0.1, 0.2, waker=waker, kstack=FUTEX_STACK, runq=0.0002, pystack=python)
        s.futex(holder, (k + 1) * 0.1, 0.1998, addr=0x5555_0000_2000, ustack=native, pystack=python)
        k += 1
    s.gpu_from_running(TRAINER)
    f = analyze(s.read(tmp_path)).findings.iloc[0]
    assert f.category == "lock_contention"
    assert f.evidence["user_stack"] == ";".join(leaf + python)
    assert f.evidence["allocator_in_stack"] is False
    assert f.evidence["python_frames"]["waiter"] == frames_of(python)


def test_python_frame_text_never_classifies(tmp_path):
    """Python functions named like the kernel's and the allocator's paths leave every
    number as the native stacks alone give it."""
    misleading = ("take_gil (/srv/job/gil.py:1)", "malloc_trim (/srv/job/mem.py:2)", "balance_dirty_pages (/srv/x.py:3)",
                  "handle_mm_fault (/srv/x.py:4)", "futex_wait (/srv/x.py:5)", "pthread_mutex_lock (/srv/x.py:6)")

    def trace(name, pystack):
        s = Synth()
        s.thread(TRAINER, "python")
        s.thread(WORKER, "pt_data_worker", pid=WORKER)
        for x in periodic(0.0, 10.0, 0.2):
            s.offcpu(TRAINER, x + 0.05, 0.14, waker=WORKER, kstack=SLEEP_STACK, pystack=pystack)
        s.oncpu_every(WORKER, 0.0, 10.0, hz=50, pystack=pystack)
        s.oncpu_every(TRAINER, 0.0, 10.0, hz=50, pystack=pystack)
        s.gpu_from_running(TRAINER)
        return analyze(s.read(tmp_path, name))

    with_py, without = trace("py.parquet", misleading), trace("plain.parquet", None)
    cols = ["category", "share", "seconds", "severity", "chain"]
    assert with_py.findings[cols].to_dict("records") == without.findings[cols].to_dict("records")
    assert (with_py.samples["cls"] == without.samples["cls"]).all()
    # the trainer's running time in the 5% idle: host work, "compute" with or without the frames
    assert set(with_py.findings["category"]) == {"input_pipeline", "host_compute"}
    assert with_py.findings.iloc[0].evidence["python_frames"]["waiter"][0]["function"] == "take_gil"


@pytest.mark.parametrize("scenario", [input_pipeline, python_pipeline])
def test_without_python_stacks_the_output_is_unchanged(tmp_path, scenario):
    """Python stack ids all null: no python_frames, no python line; a trace with them
    reads the same numbers."""
    s = scenario()
    if scenario is python_pipeline:  # the same rows with the Python stacks left out
        for rows in s.rows.values():
            for row in rows:
                row.pop("pystack_id", None)
                row.pop("peer_pystack_id", None)
        s.rows["stack"] = [r for r in s.rows["stack"] if r["state"] != "python"]
    path = s.write(tmp_path / "t.parquet")
    doc = json.loads(run_analyze(path=path, fmt="json"))
    assert all("python_frames" not in f["evidence"] for f in doc["findings"])
    text = run_analyze(path=path, fmt="text")
    assert "python:" not in text
    assert "Python:" not in run_analyze(path=path, fmt="html")


def test_shown_frame_skips_library_code():
    frames = frames_of(TRAINER_PY)
    assert shown_frame(frames)["function"] == "train_step"
    only_library = frames_of(PUT_PY)
    assert shown_frame(only_library) == only_library[0]
    assert shown_frame([]) is None


def test_running_waiter_is_named_by_its_samples_in_the_fault_path(tmp_path):
    """A trainer that never blocks and faults in 40% of its samples: the Python code of
    the faulting samples, though other code has more samples."""
    faulting = ("fill_buffer (/srv/job/buffers.py:7)", "train_step (/srv/job/train.py:60)")
    other = ("forward (/srv/job/model.py:12)", "train_step (/srv/job/train.py:58)")
    s = Synth()
    s.thread(TRAINER, "python")
    for i, ts in enumerate(periodic(0.0, 10.0, 0.01)):
        in_fault = i % 10 < 4
        s.oncpu(TRAINER, ts, kstack=FAULT_STACK if in_fault else None, pystack=faulting if in_fault else other)
    s.gpu_series(lambda ts: 3.0)
    findings = analyze(s.read(tmp_path)).findings
    assert findings["category"].tolist() == ["host_compute", "page_faults"]  # the rest: user work, host-bound
    f = findings.iloc[1]
    assert f.evidence["python_frames"] == {"waiter": frames_of(faulting), "producer": []}


def test_blocked_producer_is_named_by_its_stack_where_it_blocked(tmp_path):
    """trainer <- worker <- checkpoint writer throttled in balance_dirty_pages: the
    producer is the writer, named by its Python stack at the throttled writes."""
    writing = ("write (/srv/job/ckpt.py:22)", "save_checkpoint (/srv/job/ckpt.py:40)")
    waiting = ("recv (/srv/job/worker.py:5)",)
    s = Synth(duration_s=9.0)
    s.thread(TRAINER, "python")
    s.thread(200, "pt_data_worker")
    s.thread(300, "ckpt_writer")
    for x in periodic(0.0, 9.0, 0.3):
        s.offcpu(TRAINER, x + 0.1, 0.2, waker=200, kstack=FUTEX_STACK, pystack=TRAINER_PY)
        s.futex(TRAINER, x + 0.1, 0.2, addr=0x7F00_0000_1000)
        s.offcpu(200, x + 0.04, 0.25, waker=300, kstack=SLEEP_STACK, pystack=waiting)
        s.offcpu(300, x + 0.03, 0.25, state="D", kstack=DIRTY_STACK, pystack=writing)
        s.dirty_pause(300, x + 0.03, 0.25)
    s.gpu_from_running(TRAINER)
    doc = json.loads(run_analyze(path=s.write(tmp_path / "t.parquet"), fmt="json"))
    f = doc["findings"][0]
    assert f["category"] == "dirty_throttling"
    assert [c["tid"] for c in f["chain"]] == [TRAINER, 200, 300]
    assert f["evidence"]["python_frames"] == {"waiter": frames_of(TRAINER_PY), "producer": frames_of(writing)}
    assert python_line(f) == f"trainer {TRAINER}: train.py:54 train_step ← checkpoint 300: ckpt.py:22 write"
