"""What took the CPU from the trainer: the sched probe counts each traced thread's
preemptions per task that ran instead (probes/sched.bpf.c), the recorder drains them at
each flush into `preempted_by` rows (tracer/collectors/sched.py), and a cpu_contention finding names
those tasks in its evidence, its culprits and the text report."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kernel_env import require_root
from recording import record_workload
from synth import TRAINER, WORKER, Synth, periodic, t
from trainbpf.analyzers.options import Window
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import build_report
from trainbpf.reports.render import run_analyze
from trainbpf.trace.asuser import Invoker
from trainbpf.trace.reader import read_trace
from trainbpf.tracer import access
from trainbpf.tracer.collectors import sched
from trainbpf.tracer.settings import Settings

KEY = np.dtype([("tid", "<u4"), ("peer_tid", "<u4")])
COUNT = np.dtype([("preemptions", "<u8"), ("pid", "<u4"), ("pad", "<u4"), ("comm", "S1", (16,))])
HOG_COMM = "tb_cpuhog"


def counts(*rows: tuple[int, int, int, int, str]) -> tuple[np.ndarray, np.ndarray]:
    """The preemptions map's keys and values as drained: (tid, peer_tid, preemptions, pid, comm)."""
    keys = np.array([(tid, nxt) for tid, nxt, *_ in rows], dtype=KEY)
    values = np.zeros(len(rows), dtype=COUNT)
    for i, (_, _, n, pid, comm) in enumerate(rows):
        values[i]["preemptions"], values[i]["pid"] = n, pid
        values[i]["comm"] = np.frombuffer(comm.encode().ljust(16, b"\0"), dtype="S1")
    return keys, values


def test_drained_preemptions_become_rows_naming_each_task_and_its_process():
    keys, values = counts((100, 4242, 17, 100, HOG_COMM), (101, 4243, 2, 100, "kworker/1:1"), (100, 9999, 1, 100, "gone"))
    batch = sched.preempted_by_batches(keys, values, 5_000, {4242: 4240, 4243: 4243, 9999: -1})[0]
    rows = batch.to_pandas()
    assert set(rows["kind"]) == {"preempted_by"}
    assert rows[["tid", "pid", "peer_tid", "comm", "count"]].values.tolist() == [
        [100, 100, 4242, HOG_COMM, 17], [101, 100, 4243, "kworker/1:1", 2], [100, 100, 9999, "gone", 1]]
    assert rows["peer_pid"].tolist()[:2] == [4240, 4243]
    assert rows["peer_pid"].isna().tolist() == [False, False, True], "a task gone by the flush has no pid"
    assert (rows["ts_ns"] == 5_000).all()
    assert sched.preempted_by_batches(*counts(), 5_000, {}) == []


def test_a_task_that_keeps_preempting_is_looked_up_in_proc_once(monkeypatch):
    """The drain reads a peer's tgid from /proc once while it keeps showing up, and again
    once it has been absent from a drain."""
    drained = [counts((100, 4242, 3, 100, HOG_COMM)), counts((100, 4242, 1, 100, HOG_COMM), (100, 7, 1, 100, "x")),
               counts((100, 7, 1, 100, "x")), counts((100, 4242, 1, 100, HOG_COMM))]
    looked_up: list[int] = []
    monkeypatch.setattr(sched, "drain_hash", lambda table: drained.pop(0))
    monkeypatch.setattr(sched, "tgid_of", lambda tid: looked_up.append(tid) or tid - 2)
    collector = sched.SchedCollector(Settings())
    peers = [collector.preempted_by({"preemptions": None}, 1)[0].to_pandas()["peer_pid"].tolist() for _ in range(4)]
    assert peers == [[4240], [4240, 5], [5], [4240]]
    assert looked_up == [4242, 7, 4242]


def test_under_sudo_a_task_the_user_cannot_see_is_left_unnamed(monkeypatch, tmp_path):
    """With /proc mounted hidepid, the sudo user sees only their own processes: a
    preempting task of another user is counted but neither named nor numbered."""
    monkeypatch.setattr(sched, "drain_hash", lambda table: counts((100, 4242, 3, 100, HOG_COMM), (100, 555, 2, 100, "mine")))
    monkeypatch.setattr(sched, "tgid_of", lambda tid: tid)
    collector = sched.SchedCollector(Settings())
    collector.peer_visible = lambda pid: pid == 555
    rows = collector.preempted_by({"preemptions": None}, 1)[0].to_pandas()
    assert rows[["peer_tid", "comm", "count"]].values.tolist() == [[0, "", 3], [555, "mine", 2]]
    assert rows["peer_pid"].isna().tolist() == [True, False]


@pytest.mark.parametrize(("options", "hides"), [("rw,hidepid=2,gid=4", True), ("rw,hidepid=invisible", True),
                                                ("rw,hidepid=0", False), ("rw,nosuid", False)])
def test_hidepid_is_read_from_the_proc_mount(tmp_path, options, hides):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 0:5 / /sys rw - sysfs sysfs rw\n"
                         f"23 1 0:21 / /proc rw,nosuid shared:12 - proc proc {options}\n")
    assert access.proc_hides_processes(str(mountinfo)) is hides
    assert access.proc_hides_processes(str(tmp_path / "missing")) is True


def test_the_sudo_user_sees_their_own_processes_only_behind_hidepid():
    gate = access.Gate(Invoker(uid=os.getuid() + 12345, gid=0, groups=frozenset()), hidden_proc=True)
    assert not gate.sees(os.getpid())
    assert access.Gate(Invoker(uid=os.getuid(), gid=0, groups=frozenset()), hidden_proc=True).sees(os.getpid())
    assert access.Gate(Invoker(uid=os.getuid() + 12345, gid=0, groups=frozenset()), hidden_proc=False).sees(1)


def test_the_process_of_a_thread_is_read_from_proc():
    from trainbpf.tracer.proctree import tgid_of

    box: dict[str, int] = {}
    done = threading.Event()

    def worker() -> None:
        box["tid"] = threading.get_native_id()
        done.wait(5)

    th = threading.Thread(target=worker)
    th.start()
    try:
        while "tid" not in box:
            time.sleep(0.001)
        assert box["tid"] != os.getpid() and tgid_of(box["tid"]) == os.getpid()
    finally:
        done.set()
        th.join()
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid is free
    assert tgid_of(child.pid) == -1, "a task gone has no process"


def contended() -> Synth:
    """The trainer waits 120 ms runnable in every 200 ms; a hog outside the tree preempts
    it 3 times a second, a traced worker once, and a task preempts only the worker."""
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(WORKER, "pt_data_worker", pid=WORKER)
    for x in periodic(0.0, s.duration_s, 0.2):
        s.offcpu(TRAINER, x + 0.08, 0.12, state="R", runq=0.12)
    for flush in np.arange(1, 11) - 0.001:  # each flush before the trace's end
        s.add("preempted_by", ts_ns=t(flush), tid=TRAINER, pid=TRAINER, peer_tid=4242, peer_pid=4240, comm=HOG_COMM, count=3)
        s.add("preempted_by", ts_ns=t(flush), tid=TRAINER, pid=TRAINER, peer_tid=WORKER, peer_pid=WORKER,
              comm="pt_data_worker", count=1)
        s.add("preempted_by", ts_ns=t(flush), tid=WORKER, pid=WORKER, peer_tid=777, peer_pid=777, comm="other", count=9)
    s.add("preempted_by", ts_ns=t(flush), tid=TRAINER, pid=TRAINER, peer_tid=5000, peer_pid=None, comm="short_lived", count=1)
    s.gpu_from_running(TRAINER)
    return s


def test_cpu_contention_names_the_tasks_that_preempted_its_threads(tmp_path):
    path = contended().write(tmp_path / "t.parquet")
    doc = build_report(analyze(read_trace(path)))
    f = doc["findings"][0]
    assert f["category"] == "cpu_contention"
    assert f["evidence"]["preemptions"] == 41
    assert f["evidence"]["preempted_by"] == [
        {"tid": 4242, "pid": 4240, "comm": HOG_COMM, "preemptions": 30, "traced": False},
        {"tid": WORKER, "pid": WORKER, "comm": "pt_data_worker", "preemptions": 10, "traced": True},
        {"tid": 5000, "pid": None, "comm": "short_lived", "preemptions": 1, "traced": False}]
    assert f["culprits"][1:] == [
        {"kind": "process", "name": HOG_COMM, "pid": 4240, "tid": 4242, "count": 30},
        {"kind": "process", "name": "pt_data_worker", "pid": WORKER, "tid": WORKER, "count": 10},
        {"kind": "process", "name": "short_lived", "pid": None, "tid": 5000, "count": 1}]
    text = run_analyze(path=path, fmt="text")
    # each task by its tid, as every line names a thread, and its process where that differs
    assert (f"took the CPU: {HOG_COMM} (4242, pid 4240) 30 times, pt_data_worker ({WORKER}) 10 times, "
            "short_lived (5000) 1 time") in text
    # Over the first 4.5 s: the flushes at 1..4 s.
    windowed = build_report(analyze(read_trace(path), window=Window(0, 4.5)))["findings"][0]["evidence"]
    assert [(p["tid"], p["preemptions"]) for p in windowed["preempted_by"]] == [(4242, 12), (WORKER, 4)]


HOG = """
import ctypes, os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)
print(flush=True)
while True:
    pass
"""


def start_hogs(cpu: int, names: list[str]) -> list[subprocess.Popen]:
    """Busy processes outside any traced tree, each pinned to `cpu` and named."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(cpu), name], stdout=subprocess.PIPE) for name in names]
    for h in hogs:
        h.stdout.readline()  # pinned and named
    return hogs


def stop(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def test_a_cpu_hog_in_another_process_is_named_as_what_preempted_the_trainer(tmp_path):
    """A trainer doing 5 ms bursts on the CPU a busy process of its own is pinned to: the
    trace names the hog (tid, pid, comm) as what preempted it, and the report's
    cpu_contention finding blames it as a process."""
    require_root()
    cpu = max(os.sched_getaffinity(0))
    hogs = start_hogs(cpu, [HOG_COMM])
    try:
        rec = record_workload(tmp_path / "trace.parquet", "bursts", cpu, "2.0", probes=["sched"])
    finally:
        stop(hogs)
    hog, trainer = hogs[0].pid, rec.tids["main"]
    assert hog not in set(rec.trace.frame("thread")["tid"]), "the hog is outside the traced tree"
    rows = rec.trace.view("preempted_by")
    by_hog = rows[rows["peer_tid"] == hog]
    assert len(by_hog), f"no preemption by the hog: {rows[['tid', 'peer_tid', 'comm', 'preemptions']].values.tolist()}"
    assert set(by_hog["tid"]) == {trainer} and set(by_hog["pid"]) == {rec.pid}
    assert set(by_hog["peer_pid"]) == {hog} and set(by_hog["comm"]) == {HOG_COMM}
    # ~190 alone; other work pinned to the same CPU on a shared machine takes its share
    per_peer = rows[rows["tid"] == trainer].groupby("peer_tid")["preemptions"].sum()
    assert per_peer[hog] >= 20, per_peer.to_dict()

    doc = build_report(analyze(rec.trace))
    finding = next((f for f in doc["findings"] if f["category"] == "cpu_contention"), None)
    assert finding is not None, [(f["category"], f["share"]) for f in doc["findings"]]
    assert {"tid": hog, "pid": hog, "comm": HOG_COMM, "preemptions": int(per_peer[hog]), "traced": False} \
        in finding["evidence"]["preempted_by"]
    assert {"kind": "process", "name": HOG_COMM, "pid": hog, "tid": hog, "count": int(per_peer[hog])} in finding["culprits"]


def test_preemption_pairs_past_the_maps_size_are_counted_as_lost(tmp_path, monkeypatch):
    """Two hogs preempt the trainer every second and the map holds one pair: the other's
    preemptions are the sched probe's lost events, not dropped unseen."""
    require_root()
    monkeypatch.setattr(sched, "PREEMPTION_ENTRIES", 1)
    cpu = max(os.sched_getaffinity(0))
    hogs = start_hogs(cpu, ["tb_hog_a", "tb_hog_b"])
    try:
        rec = record_workload(tmp_path / "trace.parquet", "bursts", cpu, "2.0", probes=["sched"],
                              settings=Settings(python_frames=False))
    finally:
        stop(hogs)
    rows = rec.trace.view("preempted_by")
    assert len(rows), "no preemption was counted at all"
    assert rows.groupby("ts_ns").size().max() == 1, "a drain held more pairs than the map's one entry"
    assert rec.result.lost["sched"] > 0, rec.result.lost
