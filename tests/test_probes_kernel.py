"""Every probe, loaded into the running kernel and triggered by a real workload."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kernel_env import dirty_limits, memory_cgroup, require_root
from recording import record_workload
from trainbpf.trace.schema import MACHINE_WIDE_KINDS
from trainbpf.tracer.settings import Settings

pytestmark = pytest.mark.kernel

BUSY_OUTSIDER = r"""
import mmap, threading, time
def churn():
    while True:
        m = mmap.mmap(-1, 1 << 20); m[0] = 1; m.close()
        threading.Event().wait(0.0005)
threading.Thread(target=churn, daemon=True).start()
end = time.time() + 120
while time.time() < end:
    pass
"""


@pytest.fixture(scope="module")
def basic(tmp_path_factory):
    require_root()
    outsider = subprocess.Popen([sys.executable, "-c", BUSY_OUTSIDER])
    try:
        rec = record_workload(tmp_path_factory.mktemp("basic") / "trace.parquet", "basic")
    finally:
        outsider.kill()
        outsider.wait()
    rec.outsider = outsider.pid
    return rec


def test_futex_wait_of_50ms(basic):
    f = basic.trace.frame("futex")
    mine = f[f.tid == basic.tids["waiter"]]
    assert len(mine) >= 1, "no futex wait recorded for the waiting thread"
    longest = mine.dur_ns.max() / 1e6
    assert 45 <= longest <= 80, f"longest futex wait {longest:.1f} ms, expected ~50 ms"
    assert (mine.pid == basic.pid).all()


def test_futex_addresses_are_described(basic):
    """Every futex address waited on is described; the GIL's lies in _PyRuntime."""
    f = basic.trace.frame("futex")
    described = basic.trace.frame("futex_addr")
    waited = set(zip(f.pid.astype(int), f.addr.astype("uint64")))
    known = set(zip(described.pid.astype(int), described.addr.astype("uint64")))
    assert waited <= known, f"{len(waited - known)} futex addresses not described"
    assert not described.duplicated(["pid", "addr"]).any()
    spinners = f[f.tid.isin([basic.tids["gil0"], basic.tids["gil1"]])]
    assert len(spinners) >= 2, "no futex waits while two threads contended for the GIL"
    names = described.set_index(described.addr.astype("uint64"))["name"]
    gil = [str(names.get(a, "")) for a in spinners.addr.astype("uint64")]
    assert sum(n.startswith("_PyRuntime+") for n in gil) >= 0.9 * len(gil), gil[:10]
    assert (described.loc[described.name.str.startswith("_PyRuntime+", na=False), "state"] == "image").all()


def test_producer_appears_as_waker(basic):
    off = basic.trace.frame("offcpu")
    consumer = off[(off.tid == basic.tids["main"]) & (off.state == "S")]
    wakers = consumer.peer_tid.dropna().astype(int).tolist()
    assert wakers.count(basic.tids["producer"]) >= 3, f"wakers of the consumer: {wakers}"
    woken = consumer[consumer.peer_tid == basic.tids["producer"]]
    assert (woken.dur_ns >= 20e6).sum() >= 3, "the consumer should wait ~30 ms per hand-off"
    # A waker in task context: neither its kernel nor its native user stack is taken
    # (sched.bpf.c; its Python stack is, where Python frames are walked).
    assert (woken.peer_kstack_id == -1).all() and woken.peer_ustack_id.isna().all()


def test_timer_wakeups_name_no_waker(basic):
    """A timer wake-up runs in interrupt context: whoever it interrupted (here mostly a
    traced spinner on the sleeper's CPU) is not its waker; its kernel stack says what woke it."""
    off = basic.trace.frame("offcpu")
    naps = off[(off.tid == basic.tids["sleeper"]) & (off.state == "S") & (off.dur_ns >= 15e6)]
    assert len(naps) >= 8, f"{len(naps)} timer sleeps of ~20 ms recorded, expected 10"
    assert naps.peer_tid.isna().all(), f"wakers named for timer wake-ups: {naps.peer_tid.tolist()}"
    # A timer that fires while another BPF program runs on that CPU (the spinner's on-CPU
    # sample, its switch) is not seen: the kernel skips sched_waking then, and counts it.
    unseen = int((naps.peer_kstack_id < 0).sum())
    skipped = basic.trace.meta["missed_runs"].get("sched:sched_waking", 0)
    assert unseen <= skipped, f"{unseen} timer wake-ups without the kernel stack that shows it, {skipped} skipped"
    assert unseen <= len(naps) // 2, f"{unseen} of {len(naps)} timer wake-ups unseen"
    stacks = basic.trace.frame("stack")
    frames = stacks[stacks.state == "kernel"].set_index("kstack_id")["name"]
    woke = [str(frames.get(int(k), "")) for k in naps.peer_kstack_id if k >= 0]
    assert all("hrtimer" in f for f in woke), woke[:3]


def test_200mb_touch_counts_50k_faults(basic):
    faults = basic.trace.frame("faults")
    n = int(faults[faults.tid == basic.tids["toucher"]]["count"].sum())
    # 51,200 pages, one fault each; the rest is the thread's own start (its stack, Python's).
    assert 51_200 <= n <= 52_500, f"{n} faults for the touching thread"
    counters = basic.trace.meta["faults"]  # what the recording says of its counting
    assert counters["exit_counts"] == 1 and counters["counted"] >= n and counters["reads"] > 0, counters


def test_mmap_munmap_64mb_with_sizes(basic):
    mm = basic.trace.frame("mm_syscall")
    main = mm[mm.tid == basic.tids["main"]]
    for call in ("mmap", "munmap"):
        sized = main[(main.name == call) & (main["size"] == 64 << 20)]
        assert len(sized) >= 4, f"{len(sized)} {call} calls of 64 MB"
        assert (sized.dur_ns > 0).all()


def test_child_forked_after_start_is_followed_and_named(basic):
    child = basic.tids["child"]
    threads = basic.trace.frame("thread")
    rows = threads[threads.tid == child]
    assert "process" in set(rows.name), "the fork was not seen"
    assert "tb_child" in set(rows.comm), f"child names seen: {set(rows.comm)}"
    assert int(rows.peer_tid.dropna().iloc[0]) == basic.tids["main"]
    off = basic.trace.frame("offcpu")
    assert (off.tid == child).any(), "no off-CPU interval for the child"
    exits = basic.trace.frame("exit")
    assert (exits.tid == child).any()


def test_busy_process_outside_the_tree_adds_no_rows(basic):
    t = basic.trace.table.to_pandas()
    # the disk and interface counts name every task's I/O (docs/trace-format.md), by design
    t = t[~t["kind"].isin(MACHINE_WIDE_KINDS)]
    # named as a task that preempted a traced thread (peer_tid, peer_pid), by design
    preempting = t["kind"] == "preempted_by"
    for col in ("tid", "pid", "peer_tid", "peer_pid"):
        rows = t[col] if col in ("tid", "pid") else t.loc[~preempting, col]
        assert not (rows == basic.outsider).any(), f"outsider {basic.outsider} found in {col}"
    # other processes appear only as wakers of traced threads (the test itself, writing
    # "go" to the workload's stdin, is one), with their user stacks
    wakers = set(basic.trace.frame("offcpu").peer_pid.dropna().astype(int))
    assert set(t.pid.dropna().astype(int)) <= {basic.pid, basic.tids["child"], 0} | wakers


def test_target_exit_ends_recording_with_complete_trace(basic):
    assert basic.result.stop_reason == "target exited"
    assert basic.trace.meta["complete"] is True
    assert basic.trace.path.suffix == ".parquet"
    assert not basic.trace.path.with_name("trace.parquet.spool").exists()
    assert basic.result.lost == {k: 0 for k in basic.result.lost}


def test_runs_the_kernel_skipped_are_counted_by_attach_point(basic):
    """The programs' own recursion_misses, named by what they attach to: a program
    skipped while another ran on its CPU is not a silent loss."""
    from trainbpf.tracer import loader

    settings = Settings()
    points = {tp for c in loader.select(None, settings)
              for tp in (*c.tracepoints, *c.optional_tracepoints, *c.optional_raw_tracepoints)}
    points |= {tp.replace("sys_enter_", "sys_exit_").replace("_begin", "_end") for tp in points}  # pairs' ends
    missed = basic.trace.meta["missed_runs"]
    assert all(isinstance(n, int) and n > 0 for n in missed.values()), missed
    unknown = set(missed) - points - {"on_cpu_sample"}
    assert not unknown, f"missed runs of programs named neither by tracepoint nor as the sampler: {unknown}"


def test_stacks_are_symbolised(basic):
    stacks = basic.trace.frame("stack")
    kernel = stacks[stacks.state == "kernel"]
    assert kernel.name.str.contains("schedule").any()
    off = basic.trace.frame("offcpu")
    ids = set(off.kstack_id[off.kstack_id >= 0])
    assert ids <= set(kernel.kstack_id), "off-CPU stacks without a symbolised row"
    depth = stacks.name.str.count(";") + 1
    assert depth.max() <= 32, "the kernel keeps 32 frames a stack (probes/common.h STACK_FRAMES)"
    meta = basic.trace.meta["stacks"]
    assert (meta["frames"], meta["entries"]) == (32, 65536)
    # Collisions are by hash and so by chance: a few stack walks in 64k buckets, not many.
    walks = sum(int((basic.trace.frame(kind)[col] >= 0).sum())
                for kind, cols in (("offcpu", ("kstack_id", "ustack_id")), ("oncpu", ("kstack_id", "ustack_id")),
                                   ("futex", ("ustack_id",))) for col in cols)
    assert 0 <= meta["collisions"] <= 0.05 * walks <= 0.05 * meta["walks"], (meta, walks)


def test_a_forked_worker_that_exits_before_the_stop_is_named(tmp_path):
    """User stacks are named after the stop (tracer/symbols/stacks.py), from the maps and files
    kept when the worker's stacks were first seen: the worker is gone by then."""
    require_root()
    rec = record_workload(tmp_path / "trace.parquet", "forked_worker", "2.5")
    worker = rec.tids["worker"]
    exits = rec.trace.frame("exit")
    assert (exits.tid == worker).any(), "the worker's exit was not seen"
    assert int(exits[exits.tid == worker].ts_ns.min()) < rec.trace.meta["clock"]["end_mono_ns"] - 10**9
    off = rec.trace.frame("offcpu")
    ids = set(off[(off.pid == worker) & (off.ustack_id >= 0)].ustack_id.astype(int))
    assert ids, "no user stacks for the worker's naps"
    stacks = rec.trace.frame("stack")
    names = stacks[(stacks.state == "user") & (stacks.pid == worker) & stacks.kstack_id.isin(ids)].name
    assert len(names) == len(ids), "user stacks of the worker without a name row"
    assert all("[libc.so.6]" in n for n in names), list(names)[:5]


def test_stack_map_collisions_are_counted_and_reported(tmp_path):
    """A stack map of 4 buckets: most distinct stacks find theirs taken, and the trace and
    the text report say how many were not kept."""
    require_root()
    rec = record_workload(tmp_path / "trace.parquet", "basic", settings=Settings(stack_entries=4))
    stacks = rec.trace.frame("stack")
    stacks = stacks[stacks.state != "python"]  # Python stacks have their own table (probes/pyframes.h)
    collided = rec.trace.meta["stacks"]["collisions"]
    assert stacks.kstack_id.nunique() <= 4, "more stacks kept than the map holds"
    walks = rec.trace.meta["stacks"]["walks"]
    assert collided >= 10 and walks >= collided + stacks.kstack_id.nunique(), rec.trace.meta["stacks"]
    out = subprocess.run([sys.executable, "-m", "trainbpf.cli", "analyze", str(rec.trace.path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"NOTE: {collided} of {walks} stack walks" in out.stdout


def test_dirty_throttling_pauses_the_writer(tmp_path):
    require_root("changes vm.dirty_bytes")
    # Limits far below what the writer dirties in a moment: throttled on any disk (with
    # 8/4 MiB a fast writer on a slow disk met 6-11 pauses in 1 GB; with these, ~500).
    with dirty_limits(dirty_bytes=2 << 20, background_bytes=1 << 20):
        rec = record_workload(tmp_path / "trace.parquet", "dirty", str(tmp_path / "big.bin"), 256)
    pauses = rec.trace.frame("dirty_pause")
    mine = pauses[pauses.tid == rec.tids["writer"]]
    assert len(mine) >= 10, f"{len(mine)} balance_dirty_pages pauses for the writer"
    assert (mine.dur_ns > 0).all()
    assert (mine.dur_ns % 1_000_000 == 0).all(), "the tracepoint reports pauses in whole milliseconds"
    # Each pause is a sleep: the writer goes off-CPU right after the event, for about the
    # pause (at least the pause less one tick).
    tick_ns = 1_000_000_000 // rec.trace.meta["thresholds"]["hz"]
    off = rec.trace.frame("offcpu")
    off = off[off.tid == rec.tids["writer"]].sort_values("ts_ns")
    pos = np.searchsorted(off.ts_ns.to_numpy(), mine.ts_ns.to_numpy())
    ok = pos < len(off)
    slept = off.iloc[pos[ok]]
    gap = slept.ts_ns.to_numpy() - mine.ts_ns.to_numpy()[ok]
    matched = (gap < 1_000_000) & (slept.dur_ns.to_numpy() >= mine.dur_ns.to_numpy()[ok] - tick_ns)
    assert matched.sum() >= 0.9 * len(mine), (
        f"{matched.sum()} of {len(mine)} pauses followed by an off-CPU interval as long")
    assert mine.dur_ns.sum() <= off.dur_ns.sum(), "more pause time than off-CPU time"


def test_memory_limited_cgroup_reclaims(tmp_path):
    require_root("creates a memory cgroup")
    with memory_cgroup(48 << 20) as procs:
        rec = record_workload(tmp_path / "trace.parquet", "reclaim", str(tmp_path / "big.bin"), 192,
                              cgroup_procs=procs)
    reclaim = rec.trace.frame("reclaim")
    mine = reclaim[reclaim.tid == rec.tids["reclaimer"]]
    assert len(mine) >= 1, "no reclaim recorded for the thread inside the cgroup"
    assert set(mine.state) <= {"memcg", "direct"}
    assert mine["count"].sum() > 0, "reclaim freed no pages"


def test_decoded_event_sizes_match_the_c_structs():
    """Load every probe, trigger each ring buffer once, and compare the size the kernel
    delivered with the numpy dtype and the ctypes class built from the C struct."""
    require_root()
    from bcc.table import _get_event_class

    from trainbpf.tracer import loader
    from trainbpf.tracer.settings import Settings

    settings = Settings(min_block_ns=1000, min_futex_ns=1000, oncpu_hz=999)
    collectors = loader.select(None, settings)
    bpf = loader.load(collectors, settings)
    try:
        dtypes = loader.event_dtypes(bpf, collectors)
        seen: dict[str, set[int]] = {rb: set() for rb in dtypes}
        for rb in dtypes:
            bpf[rb].open_ring_buffer(lambda ctx, data, size, rb=rb: seen[rb].add(size))
        me = threading.get_native_id()
        loader.set_traced(bpf, me, me)  # this test process is the traced tree
        worker = threading.Thread(target=lambda: threading.Event().wait(0.01))  # task + futex
        worker.start()
        worker.join()
        time.sleep(0.01)  # off-CPU
        import mmap

        with open("/tmp/trainbpf-size-test", "wb") as fh:  # block: a synced write
            fh.write(b"x" * (1 << 20))
            fh.flush()
            import os

            os.fsync(fh.fileno())
        m = mmap.mmap(-1, 1 << 20)  # mm
        m.close()
        import socket

        left, right = socket.socketpair()  # net: a socket this thread sends and receives on
        with left, right:
            left.send(b"x")
            right.recv(1)
        end = time.time() + 0.3
        while time.time() < end:  # on-CPU samples
            pass
        bpf.ring_buffer_poll(100)
        bpf.ring_buffer_consume()
        for rb, dtype in dtypes.items():
            cls = _get_event_class(bpf[rb])
            assert dtype.itemsize == ctypes.sizeof(cls), rb
            assert seen[rb] <= {dtype.itemsize}, f"{rb}: kernel delivered {seen[rb]}, dtype {dtype.itemsize}"
        triggered = {rb for rb, s in seen.items() if s}
        # writeback needs dirty pressure, cuda a CUDA library, nccl an NCCL library: each is
        # covered by its own test
        untriggered = {"writeback_events", "cuda_events", "nccl_events"}
        assert triggered >= set(dtypes) - untriggered, f"not triggered: {set(dtypes) - triggered}"
    finally:
        bpf.cleanup()


def test_system_wide_recording_sees_other_processes_but_not_itself(tmp_path):
    require_root()
    from trainbpf.trace.reader import read_trace
    from trainbpf.tracer.record import record
    from trainbpf.tracer.record_config import RecordConfig
    from trainbpf.tracer.settings import Settings

    other = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.005)"])
    try:
        record(config=RecordConfig(pid=None, output=tmp_path / "node.parquet", duration=2,
                                   settings=Settings(trace_all=True), gpu="off"), handle_signals=False)
    finally:
        other.kill()
        other.wait()
    trace = read_trace(tmp_path / "node.parquet")
    off = trace.frame("offcpu")
    assert (off.pid == other.pid).sum() >= 50, "the sleeping process should show many off-CPU intervals"
    assert (off.pid != 0).all(), "every interval carries its process id"
    rows = trace.table.to_pandas()
    assert not (rows.pid == os.getpid()).any(), "the recorder must not trace itself"
    threads = trace.frame("thread")
    assert other.pid in set(threads.tid)


def test_a_thread_blocked_for_the_whole_recording_is_blocked_not_running(tmp_path):
    """Waits that began before the recording, or never ended, are off-CPU time too."""
    require_root()
    from trainbpf.trace.reader import read_trace
    from trainbpf.tracer.record import record
    from trainbpf.tracer.record_config import RecordConfig

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # asleep before the recorder attaches
        record(config=RecordConfig(pid=sleeper.pid, output=tmp_path / "t.parquet", duration=2, gpu="off"),
               handle_signals=False)
    finally:
        sleeper.kill()
        sleeper.wait()
    trace = read_trace(tmp_path / "t.parquet")
    clock = trace.meta["clock"]
    span = clock["end_mono_ns"] - clock["start_mono_ns"]
    off = trace.frame("offcpu")
    mine = off[off.tid == sleeper.pid]
    assert len(mine) == 1, mine
    row = mine.iloc[0]
    assert row.state == "S" and row.cpu == -1, "still asleep when the recording stopped"
    assert row.ts_ns == clock["start_mono_ns"] and row.ts_ns + row.dur_ns == clock["end_mono_ns"]
    assert span >= 1.9e9


def test_short_waits_past_the_maps_size_are_counted_as_lost(tmp_path, monkeypatch):
    """Every off-CPU interval is short (min_block 1 s) and the short-wait map holds one
    (thread, state) pair: the others of each second are counted as the sched probe's
    lost events, not dropped unseen."""
    require_root()
    from trainbpf.tracer.collectors import sched

    monkeypatch.setattr(sched, "SHORT_WAIT_ENTRIES", 1)
    rec = record_workload(tmp_path / "trace.parquet", "basic", probes=["sched"],
                          settings=Settings(min_block_ns=1_000_000_000, python_frames=False))
    short = rec.trace.frame("offcpu_short")
    assert len(short) > 0, "no short wait was summed at all"
    assert short.groupby("ts_ns").size().max() == 1, "a drain held more pairs than the map's one entry"
    assert rec.result.lost["sched"] > 0, rec.result.lost
    assert rec.trace.meta["lost"]["sched"] == rec.result.lost["sched"]


def test_exited_threads_leave_the_per_thread_maps(tmp_path, monkeypatch):
    """sched.bpf.c and futex.bpf.c keep an entry per traced thread, rewritten in place,
    and an entry means "traced": the recorder must remove an exited thread's entries, or
    the maps fill with the dead and a reused tid counts as traced."""
    require_root()
    from trainbpf.tracer.record import Recorder

    left: dict[str, set[int]] = {}
    stop_tracing = Recorder._stop_tracing

    def snapshot_then_stop(self):
        for name in ("sched_threads", "futex_waiting"):
            left[name] = {k.value for k in self.bpf[name].keys()}
        return stop_tracing(self)

    monkeypatch.setattr(Recorder, "_stop_tracing", snapshot_then_stop)
    rec = record_workload(tmp_path / "trace.parquet", "short_threads", 20, probes=["sched", "futex"],
                          settings=Settings(python_frames=False))
    workers = set(rec.tids["workers"])
    assert len(workers) == 20
    # each worker had entries in both maps: the futex probe saw its wait, and the sched
    # probe its switches (a streamed interval, or a short wait summed in the kernel: one
    # run in four had a worker's 30 ms interval missing though its short waits were there,
    # with no run of sched_switch skipped; an open question about the probe, not this
    # test's, which is about the entries left behind)
    assert workers <= set(rec.trace.frame("futex")["tid"]), "a worker's futex wait is missing"
    switched = set(rec.trace.frame("offcpu")["tid"]) | set(rec.trace.frame("offcpu_short")["tid"])
    assert workers <= switched, "a worker's switches are missing"
    for name, tids in left.items():
        assert not workers & tids, f"{name} still holds exited threads {sorted(workers & tids)}"


def test_threads_past_the_per_thread_maps_size_are_counted_as_lost(tmp_path, monkeypatch):
    """Node-wide, every thread that switches out or waits on a futex needs an entry in
    sched_threads and futex_waiting; with room for four, the threads past them are
    counted as the probes' lost events, not dropped unseen."""
    require_root()
    from trainbpf.trace.reader import read_trace
    from trainbpf.tracer import loader
    from trainbpf.tracer.record import record
    from trainbpf.tracer.record_config import RecordConfig

    cflags = loader.cflags
    monkeypatch.setattr(loader, "cflags", lambda *a, **k: cflags(*a, **k) + ["-DMAX_THREADS=4"])
    waiters = subprocess.Popen([sys.executable, "-c", (
        "import threading, time\n"
        "def wait():\n"
        "    while True: threading.Event().wait(0.005)\n"
        "for _ in range(8): threading.Thread(target=wait, daemon=True).start()\n"
        "time.sleep(60)\n")])
    try:
        time.sleep(0.5)
        result = record(config=RecordConfig(pid=None, output=tmp_path / "node.parquet", duration=2, probes=("sched", "futex"),
                                            settings=Settings(trace_all=True, python_frames=False), gpu="off"),
                        handle_signals=False)
    finally:
        waiters.kill()
        waiters.wait()
    assert result.lost["sched"] > 0, result.lost
    assert result.lost["futex"] > 0, result.lost
    assert read_trace(tmp_path / "node.parquet").meta["lost"]["futex"] == result.lost["futex"]
