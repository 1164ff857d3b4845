"""Host-bound time (analyzers/timeline/starvation.py, analyzers/causes/host.py; docs/findings.md "Host-bound
time"): GPU-idle time the trainer's own CPU work explains, after its named stalls and
before unwoken sleeps; split by its samples' Python frames into data loading in its own
thread (input_pipeline, the trainer as producer) and everything else (host_compute)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from synth import FUTEX_STACK, TRAINER, WORKER, Synth, periodic
from test_starvation_model import WORKED, states, windows
from trainbpf.analyzers.causes.attribution import RunSplit
from trainbpf.analyzers.causes.host import HOST_LABEL_CODE, HostSplit
from trainbpf.analyzers.pipeline import analyze
from trainbpf.analyzers.timeline.cuda_calls import split_at_waits
from trainbpf.analyzers.timeline.starvation import starved_pieces
from trainbpf.analyzers.vocab import RUN_CLASSES
from trainbpf.reports.document import Report
from trainbpf.reports.text import render_text

MS = 1_000_000
SITE = "/usr/lib/python3/dist-packages/torch/utils/data"
# The plain trainer: its own decode function, then the launch.
INPROC = ("decode_batch (/srv/app/inproc.py:10)", "next_batch (/srv/app/inproc.py:21)", "main (/srv/app/inproc.py:40)")
# A real DataLoader with num_workers=0: __getitem__ and the collate run in the trainer.
GETITEM = ("SlowDataset.__getitem__ (/srv/app/data.py:12)", f"fetch ({SITE}/_utils/fetch.py:51)",
           f"_SingleProcessDataLoaderIter._next_data ({SITE}/dataloader.py:674)", "train (/srv/app/train.py:30)")
COLLATE = (f"default_collate ({SITE}/_utils/collate.py:270)", f"fetch ({SITE}/_utils/fetch.py:52)",
           f"_SingleProcessDataLoaderIter._next_data ({SITE}/dataloader.py:674)", "train (/srv/app/train.py:30)")
OPTIMIZER = ("adam_step (/srv/app/train.py:44)", "train (/srv/app/train.py:31)")
SPIN = ("cuStreamSynchronize", "libcuda.so.1+0x2f3a1", "cudaStreamSynchronize")


def samples(*spans: tuple[int, int, str]) -> pd.DataFrame:
    """The trainer's user-mode on-CPU samples, one a millisecond, labelled per span
    (start_ms, end_ms, host label)."""
    ts = np.concatenate([np.arange(a, b) * MS for a, b, _ in spans]).astype(np.int64)
    label = np.concatenate([[HOST_LABEL_CODE[lab]] * (b - a) for a, b, lab in spans]).astype(np.int8)
    return pd.DataFrame({"tid": TRAINER, "ts_ns": ts, "cpu": 0,
                         "cls": pd.Categorical(["user"] * len(ts), categories=list(RUN_CLASSES)),
                         "host": label, "host_frame": ""})


def test_worked_example_host_work_comes_after_named_stalls():
    """docs/findings.md: I = 60 ms; the named stalls (30 ms) count first, then 30 of the
    50 ms the trainer ran, shared by its samples (30 ms optimizer, 20 ms decoding); the
    unwoken sleep is left nothing to cover."""
    split = samples((0, 30, "compute"), (30, 50, "loading"))
    pieces, summary = starved_pieces(WORKED, windows(("g", 0, 100, 40.0)), RunSplit(split), TRAINER,
                                     host_split=HostSplit(split))
    by_class = pieces.groupby("run_class", observed=True)["ns"].sum() / MS
    assert by_class.to_dict() == pytest.approx({"": 30.0, "compute": 18.0, "loading": 12.0})
    assert summary["host_ns"].iloc[0] == pytest.approx(50 * MS)
    assert summary["host_bound_ns"].iloc[0] == pytest.approx(30 * MS)
    assert summary["starved_ns"].iloc[0] == pytest.approx(60 * MS)
    assert summary["unwoken_idle_ns"].iloc[0] == 0.0
    # fully idle: every stall and all host work, exactly; the sleep's 20 ms said
    pieces, summary = starved_pieces(WORKED, windows(("g", 0, 100, 0.0)), RunSplit(split), TRAINER,
                                     host_split=HostSplit(split))
    assert float(pieces["ns"].sum()) == pytest.approx(80 * MS)
    assert summary["unwoken_idle_ns"].iloc[0] == pytest.approx(20 * MS)
    # fully busy: nothing
    pieces, _ = starved_pieces(WORKED, windows(("g", 0, 100, 100.0)), RunSplit(split), TRAINER,
                               host_split=HostSplit(split))
    assert float(pieces["ns"].sum()) == 0.0


def test_spinning_synchronisation_is_not_host_work():
    """The trainer spins 30 ms in the CUDA driver's synchronisation (running, GPU busy)
    and sleeps 20 ms on a timer (GPU idle): the spin explains no idle time, so the idle
    20 ms stay "not counted" rather than becoming host-bound."""
    trainer = states((0, 30, "running", -1), (30, 50, "sleep", -1))
    split = samples((0, 30, "sync"))
    pieces, summary = starved_pieces(trainer, windows(("g", 0, 50, 60.0)), RunSplit(split), TRAINER,
                                     host_split=HostSplit(split))
    assert float(pieces["ns"].sum()) == 0.0
    assert summary["host_ns"].iloc[0] == 0.0
    assert summary["unwoken_idle_ns"].iloc[0] == pytest.approx(20 * MS)


def test_cuda_launch_gaps_give_host_work_exactly():
    """With CUDA rows: running time inside a launch gap (the GPU had nothing queued) is
    host-bound whatever the sample says, also without any GPU sample; running time
    outside the gaps (work queued) is not."""
    trainer = states((0, 20, "running", -1), (20, 60, "sleep", -1), (60, 100, "running", -1))
    cut = split_at_waits(trainer, pd.DataFrame({"tid": [TRAINER], "start_ns": [20 * MS], "end_ns": [60 * MS]}))
    gaps = pd.DataFrame({"tid": [TRAINER], "start_ns": [60 * MS], "end_ns": [85 * MS], "gap_ns": [25 * MS], "wait": [0]})
    split = samples((0, 20, "compute"), (60, 100, "compute"))
    busy = windows(("g", 0, 100, 90.0))  # the sample says 10 ms idle; the gap shows 25
    pieces, summary = starved_pieces(cut, busy, RunSplit(split), TRAINER, gaps=gaps, host_split=HostSplit(split))
    assert float(pieces["ns"].sum()) == pytest.approx(25 * MS)
    assert summary["gpu_bound_ns"].iloc[0] == pytest.approx(40 * MS)
    no_samples = windows(("", 0, 100, 100.0))  # as pipeline.whole_window: no budget
    pieces, summary = starved_pieces(cut, no_samples, RunSplit(split), TRAINER, budget=False, gaps=gaps,
                                     host_split=HostSplit(split))
    assert float(pieces["ns"].sum()) == pytest.approx(25 * MS)
    assert summary["host_bound_ns"].iloc[0] == pytest.approx(25 * MS)


def busy_while_asleep(s: Synth, tid: int, period: float = 0.1) -> None:
    """GPU samples busy exactly while `tid` sleeps in synchronisations (waits no thread ends)."""
    off = [(r["ts_ns"], r["ts_ns"] + r["dur_ns"]) for r in s.rows["offcpu"] if r["tid"] == tid and r["peer_tid"] is None]
    start = s.rows["thread"][0]["ts_ns"]
    for ts in np.arange(period, s.duration_s + 1e-9, period):
        lo, hi = start + int((ts - period) * 1e9), start + int(ts * 1e9)
        s.gpu(float(ts), 100.0 * sum(max(0, min(hi, e) - max(lo, b)) for b, e in off) / (hi - lo))


def own_decoding_trainer() -> Synth:
    """The issue's first case: 20 ms decoding its own batch, then 20 ms of GPU work."""
    s = Synth(8.0)
    s.thread(TRAINER, "python")
    for x in periodic(0.0, 8.0, 0.04):
        s.oncpu_every(TRAINER, x + 0.001, x + 0.02, hz=500, pystack=INPROC)
        s.offcpu(TRAINER, x + 0.02, 0.02, state="S")  # a blocking synchronisation
    busy_while_asleep(s, TRAINER)
    return s


def test_trainer_decoding_its_own_batches_is_input_pipeline(tmp_path):
    a = analyze(own_decoding_trainer().read(tmp_path))
    assert a.starved_ns / 1e9 == pytest.approx(4.0, rel=0.01)
    assert a.host_bound_ns == pytest.approx(a.starved_ns)
    assert a.unwoken_idle_ns < 0.01e9
    f = a.findings.iloc[0]
    assert (f.category, f.severity) == ("input_pipeline", "critical")
    assert f.share == pytest.approx(1.0)
    own = f.evidence["trainer_loading"]
    assert own["functions"][0]["function"] == "decode_batch" and own["functions"][0]["line"] == 10
    assert own["dataloader_threads"] == 0
    assert [c["tid"] for c in f.chain] == [TRAINER]
    text = render_text(Report.of(a))
    assert "python (100) decoded its own batches for 4.00 s (inproc.py:10 decode_batch): the DataLoader has no workers" in text
    assert "Host-bound: 4.00 s" in text


def test_dataloader_without_workers_and_host_compute(tmp_path):
    """The issue's second case: a DataLoader with num_workers=0 (6 ms __getitem__, 2 ms
    collate), 2 ms of optimizer step, 40 ms of GPU work a step."""
    s = Synth(8.0)
    s.thread(TRAINER, "python")
    for x in periodic(0.0, 8.0, 0.05):
        s.oncpu_every(TRAINER, x + 0.0005, x + 0.006, hz=1000, pystack=GETITEM)
        s.oncpu_every(TRAINER, x + 0.0065, x + 0.008, hz=1000, pystack=COLLATE)
        s.oncpu_every(TRAINER, x + 0.0085, x + 0.010, hz=1000, pystack=OPTIMIZER)
        s.offcpu(TRAINER, x + 0.01, 0.04, state="S")
    busy_while_asleep(s, TRAINER)
    a = analyze(s.read(tmp_path))
    seconds = dict(zip(a.findings["category"], a.findings["seconds"]))
    assert seconds == pytest.approx({"input_pipeline": 1.28, "host_compute": 0.32}, rel=0.05)
    loading = a.findings.iloc[0].evidence["trainer_loading"]["functions"]
    assert [f["function"] for f in loading] == ["SlowDataset.__getitem__", "default_collate"]
    compute = a.findings.set_index("category").loc["host_compute"]
    assert compute.evidence["functions"][0]["function"] == "adam_step"
    assert compute.severity != "critical"  # 4% of the window: the loop's own overhead
    doc = Report.of(a).doc
    assert doc["host_bound_s"] == pytest.approx(1.6, rel=0.05)
    culprit = next(f for f in doc["findings"] if f["category"] == "host_compute")["culprits"][0]
    assert culprit["kind"] == "thread" and culprit["tid"] == TRAINER and culprit["function"] == "train.py:44 adam_step"


def test_workers_stay_the_producers(tmp_path):
    """The trainer waits for a worker and spends a little time receiving the batch in
    the DataLoader: input_pipeline, with the worker as its main producer."""
    s = Synth(6.0)
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    for x in periodic(0.0, 6.0, 0.05):
        s.offcpu(TRAINER, x, 0.02, waker=WORKER, kstack=FUTEX_STACK)
        s.oncpu_every(TRAINER, x + 0.0205, x + 0.022, hz=1000, pystack=GETITEM[1:])
        s.offcpu(TRAINER, x + 0.022, 0.028, state="S")
    busy_while_asleep(s, TRAINER)
    a = analyze(s.read(tmp_path))
    f = a.findings.iloc[0]
    assert f.category == "input_pipeline" and f.severity == "critical"
    assert f.evidence["producers"][0]["tid"] == WORKER
    assert "was still producing" in Report.of(a).doc["findings"][0]["summary"]


def test_html_and_health_show_host_bound_time(tmp_path):
    """The HTML timeline colours host-bound time in a row of its own; `trainbpf health`
    writes it as a series per target."""
    from trainbpf.health.config import DEFAULT_THRESHOLDS
    from trainbpf.health.outputs import metric_samples
    from trainbpf.health.results import HealthResult, grade_report
    from trainbpf.health.targets import Target
    from trainbpf.reports.html import render_html
    from trainbpf.reports.html_timeline import HOST_COLOUR

    report = Report.of(analyze(own_decoding_trainer().read(tmp_path)))
    page = render_html(report)
    assert '>host-bound</text>' in page and f'fill="{HOST_COLOUR}"' in page
    assert "<b>host-bound</b> (the trainer busy on the CPU itself): 4.00 s" in page
    target = grade_report(Target(TRAINER, "python", "python inproc.py", "pid"), report.doc, tids={TRAINER},
                          thresholds=DEFAULT_THRESHOLDS)
    assert target.host_bound_s == pytest.approx(4.0, rel=0.01) and target.host_bound_share == pytest.approx(1.0)
    series = {name: value for name, _, value in metric_samples(HealthResult(2, "node", 0.0, 1.0, "targets", [target]))}
    assert series["trainbpf_target_host_bound_seconds"] == pytest.approx(4.0, rel=0.01)
    assert series["trainbpf_target_host_bound_share_ratio"] == pytest.approx(1.0)


def test_samples_the_python_walk_missed_follow_their_stretch(tmp_path):
    """Every third sample of the decoding trainer has only native frames (inside BLAS):
    they are not "other computation", the stretch is still all data loading.  In a trace
    without any Python stack the native leaf decides: compute, named by its symbol."""
    s = Synth(4.0)
    s.thread(TRAINER, "python")
    blas = ("dgemm_kernel_SKYLAKEX [libopenblas.so]", "cblas_dgemm [libopenblas.so]")
    for x in periodic(0.0, 4.0, 0.04):
        for k, ts in enumerate(np.arange(x + 0.001, x + 0.02, 0.002)):
            s.oncpu(TRAINER, float(ts), pystack=None if k % 3 == 0 else INPROC, ustack=blas)
        s.offcpu(TRAINER, x + 0.02, 0.02, state="S")
    busy_while_asleep(s, TRAINER)
    a = analyze(s.read(tmp_path))
    assert a.findings["category"].tolist() == ["input_pipeline"]
    for rows in s.rows.values():
        for row in rows:
            row.pop("pystack_id", None)
    s.rows["stack"] = [r for r in s.rows["stack"] if r["state"] != "python"]
    native = analyze(s.read(tmp_path, "native.parquet"))
    f = native.findings.iloc[0]
    assert f.category == "host_compute" and f.evidence["functions"][0]["function"].startswith("dgemm_kernel")
    assert "while the GPU idled (dgemm_kernel_SKYLAKEX [libopenblas.so])" in Report.of(native).doc["findings"][0]["summary"]
