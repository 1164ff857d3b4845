"""One synthetic trace per finding category, each with a known answer: the top finding
names the injected cause with a share in a sane band."""

from __future__ import annotations

import pytest

from synth import (
    BLOCK_STACK, DIRTY_STACK, FAULT_IO_STACK, FAULT_STACK, FUTEX_STACK, GIL_USTACK, LOCK_USTACK,
    RECLAIM_STACK, SLEEP_STACK, TRAINER, WORKER, Synth, d, healthy, input_pipeline, periodic, t,
)
from trainbpf.analyzers.causes.categories import CATEGORIES, CATEGORY_DTYPE
from trainbpf.analyzers.pipeline import analyze


def top(analysis):
    assert len(analysis.findings), "expected at least one finding"
    return analysis.findings.iloc[0]


def check_shares(analysis):
    shares = analysis.findings["share"].to_numpy()
    assert ((shares >= 0) & (shares <= 1)).all()
    assert shares.sum() <= 1.0 + 1e-9
    assert set(analysis.findings["category"]) <= set(CATEGORIES)


def trainer_blocked_every(s: Synth, period: float, dur: float, **offcpu) -> list[float]:
    """The trainer blocks for the last `dur` seconds of every `period` (so whole 100 ms
    GPU sample periods fall inside its waits); returns when each wait starts."""
    starts = [x + period - dur for x in periodic(0.0, s.duration_s, period)]
    for x in starts:
        s.offcpu(TRAINER, x, dur, **offcpu)
    return starts


def test_input_pipeline(tmp_path):
    a = analyze(input_pipeline().read(tmp_path))
    f = top(a)
    assert f.category == "input_pipeline"
    assert 0.9 <= f.share <= 1.0
    assert f.severity == "critical"
    assert [t["tid"] for t in f.threads] == [WORKER]
    assert [c["tid"] for c in f.chain] == [TRAINER, WORKER]
    assert f.chain[1]["state"] == "running"
    assert f.evidence["trainer_waits"] == 50
    assert 138 <= f.evidence["wait_p50_ms"] <= 140
    check_shares(a)


def test_only_the_jobs_gpus_count(tmp_path):
    """A second GPU, busy with another job all along, hides the starvation when averaged
    in; the recorder saw which GPU the trainer holds, and only that one counts."""
    def trace(name, **kwargs):
        s = input_pipeline(**kwargs)
        s.gpu_series(lambda ts: 100.0, index=1)
        return s.read(tmp_path, name)

    alone = analyze(input_pipeline().read(tmp_path, "alone.parquet"))  # the same job on a node of its own
    mixed = analyze(trace("mixed.parquet"))
    # Counted as the job's, the busy GPU halves the starved time (each GPU weighs 1/2).
    assert mixed.starved_ns == pytest.approx(alone.starved_ns / 2)
    assert mixed.idle_fraction == pytest.approx(alone.idle_fraction / 2)
    mine = analyze(trace("mine.parquet", meta={"gpu": {"source": "nvidia-smi", "processes": [{"pid": 100, "uuid": "GPU-0"}]}}))
    assert top(mine).category == "input_pipeline"
    assert 0.9 <= top(mine).share <= 1.0
    assert mine.starved_ns == alone.starved_ns > 0
    assert mine.idle_fraction == alone.idle_fraction


def test_cpu_contention(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    for tid in (101, 102, 103):
        s.thread(tid, "python")
    trainer_blocked_every(s, 0.2, 0.12, state="R", runq=0.12)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "cpu_contention"
    assert f.share >= 0.95
    assert f.severity == "critical"
    assert f.evidence["runnable_intervals"] == 50
    assert 119 <= f.evidence["runq_p50_ms"] <= 121
    check_shares(a)


LOCK_ADDR = 0x5555_0000_AA00


def round_robin_lock(ustack=None, tids=(TRAINER, 101, 102), slot: float = 0.1, pystacks=None) -> Synth:
    """Python threads take one mutex in turn for `slot` seconds each; while one holds it
    the others wait on its futex, and each is woken by the previous holder's unlock.
    `pystacks`: tid -> that thread's Python stack (at its waits and at its wake-ups)."""
    py = pystacks or {}
    s = Synth()
    for tid in tids:
        s.thread(tid, "python")
    n = len(tids)
    k = 0
    while (k + n) * slot < s.duration_s:
        holder = tids[k % n]
        # The holder's next wait: from the end of its slot to the start of its next one.
        wait_start, wait_end = (k + 1) * slot, (k + n) * slot
        waker = tids[(k + n - 1) % n]  # held the slot just before `holder`'s next turn
        s.offcpu(holder, wait_start, wait_end - wait_start, waker=waker, kstack=FUTEX_STACK, runq=0.0002,
                 pystack=py.get(holder), waker_pystack=py.get(waker))
        s.futex(holder, wait_start, wait_end - wait_start - 0.0002, addr=LOCK_ADDR, ustack=ustack, pystack=py.get(holder))
        k += 1
    s.gpu_from_running(TRAINER)
    return s


def test_lock_contention(tmp_path):
    a = analyze(round_robin_lock(LOCK_USTACK).read(tmp_path))
    f = top(a)
    assert f.category == "lock_contention"
    assert f.share >= 0.9
    assert f.evidence["addresses"] == [hex(LOCK_ADDR)]
    assert f.evidence["waiting_threads"] == 3
    assert [t["tid"] for t in f.threads] == [TRAINER, 101, 102]
    assert f.evidence["allocator_in_stack"] is True
    assert "lll_lock_wait" in f.evidence["user_stack"]
    check_shares(a)


def test_lock_contention_without_symbols(tmp_path):
    """No user stacks: several waiters on one address plus handoffs make it a lock."""
    a = analyze(round_robin_lock().read(tmp_path))
    assert top(a).category == "lock_contention"
    assert top(a).evidence["handoff_share"] > 0.9


def test_lock_at_the_start_of_main_arena_is_the_allocators(tmp_path):
    """No user stacks; the recorder named the address: the allocator's own mutex."""
    s = round_robin_lock()
    s.futex_addr(LOCK_ADDR, "main_arena+0x0 [libc.so.6]")
    s.futex_addr(LOCK_ADDR, "stdout+0x8 [libc.so.6]", pid=4242)  # another process's address
    f = top(analyze(s.read(tmp_path)))
    assert f.category == "lock_contention"
    assert f.evidence["address_names"] == ["main_arena+0x0 [libc.so.6]"]
    assert f.evidence["allocator_in_stack"] is True


def test_address_in_pyruntime_is_the_gil(tmp_path):
    """Handoffs between three waiters look like a lock; the address says it is the GIL."""
    s = round_robin_lock()
    s.futex_addr(LOCK_ADDR, "[heap]", region="heap", ts=0.2)  # before an exec: superseded
    s.futex_addr(LOCK_ADDR, "_PyRuntime+0x1b0 [python3.11]", ts=0.9)
    f = top(analyze(s.read(tmp_path)))
    assert f.category == "gil_contention"
    assert f.share >= 0.9
    assert f.evidence["address_names"] == ["_PyRuntime+0x1b0 [python3.11]"]
    assert f.evidence["allocator_in_stack"] is False


def test_gil_contention(tmp_path):
    a = analyze(round_robin_lock(GIL_USTACK).read(tmp_path))
    f = top(a)
    assert f.category == "gil_contention"
    assert f.share >= 0.9
    assert "take_gil" in f.evidence["user_stack"]
    check_shares(a)


def test_gil_contention_from_timed_waits(tmp_path):
    """Without symbols: Python threads timing out in 5 ms slices on one address."""
    s = Synth()
    for tid in (TRAINER, 101):
        s.thread(tid, "python")
    for x in periodic(0.0, 10.0, 0.3):
        # 101 holds the GIL for 200 ms while the trainer waits, then the other way round.
        for tid, holder, start, length in ((TRAINER, 101, x + 0.1, 0.2), (101, TRAINER, x, 0.1)):
            slices = int(round(length / 0.005))
            for j in range(slices):  # timed 5 ms waits; the last one woken by the holder
                ts = start + j * 0.005
                s.offcpu(tid, ts, 0.005, waker=holder if j == slices - 1 else None, kstack=FUTEX_STACK)
                s.futex(tid, ts, 0.005, addr=0x5555_0000_7000)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    assert top(a).category == "gil_contention"
    assert top(a).share >= 0.9


def test_allocator_churn(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    # The trainer never blocks; 60% of its samples are in the fault path of fresh memory.
    s.oncpu_every(TRAINER, 0.0, 10.0, hz=100, kstack=lambda ts: FAULT_STACK if (ts * 100) % 10 < 6 else None)
    for x in periodic(0.0, 10.0, 0.01):
        s.mm_syscall(TRAINER, x, 0.0001, "mmap", 1 << 20)
        s.mm_syscall(TRAINER, x + 0.005, 0.0002, "munmap", 1 << 20)
        s.faults(TRAINER, x, 0.01, 256)
    s.gpu_series(lambda ts: 3.0)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "allocator_churn"
    # the GPU idles throughout: the fault path, then the trainer's user work (host-bound)
    assert f.share == pytest.approx(1.0 - a.host_bound_ns / a.starved_ns)
    assert a.findings["category"].tolist() == ["allocator_churn", "host_compute"]
    assert 5.0 <= f.seconds <= 7.0
    assert f.evidence["mm_calls_per_s"] == pytest.approx(200, rel=0.05)
    assert f.evidence["calls_by_syscall"] == {"mmap": 1000, "munmap": 1000}
    assert f.evidence["faults_per_s"] == pytest.approx(25600, rel=0.05)
    check_shares(a)


def test_allocator_churn_in_bulk(tmp_path):
    """A fresh 384 MiB buffer mapped, faulted in and unmapped every 150 ms step: few calls,
    but all the faults land on memory that is mapped only to be given back."""
    s = Synth()
    s.thread(TRAINER, "python")
    for x in periodic(0.0, 10.0, 0.15):
        s.mm_syscall(TRAINER, x, 0.0001, "mmap", 384 << 20)
        s.faults(TRAINER, x, 0.1, (384 << 20) // 4096)
        s.mm_syscall(TRAINER, x + 0.1, 0.01, "munmap", 384 << 20)
    s.oncpu_every(TRAINER, 0.0, 10.0, hz=100, kstack=lambda ts: FAULT_STACK if (ts % 0.15) < 0.1 else None)
    s.gpu_series(lambda ts: 3.0)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "allocator_churn"
    assert f.share == pytest.approx(1.0 - a.host_bound_ns / a.starved_ns)  # the rest: its user work


@pytest.mark.parametrize("advice, category", [(4, "allocator_churn"),  # MADV_DONTNEED: the pages go
                                              (14, "page_faults")])  # MADV_HUGEPAGE: the memory is kept
def test_madvise_gives_memory_back_only_when_it_drops_pages(tmp_path, advice, category):
    """A 384 MiB buffer mapped once per step, faulted in, then madvised: dropped pages
    (MADV_DONTNEED) fault in afresh each step, churn; huge-page advice keeps the memory,
    and the faults are the page-fault path of a kept buffer."""
    s = Synth()
    s.thread(TRAINER, "python")
    for x in periodic(0.0, 10.0, 0.15):
        s.mm_syscall(TRAINER, x, 0.0001, "mmap", 384 << 20)
        s.faults(TRAINER, x, 0.1, (384 << 20) // 4096)
        s.mm_syscall(TRAINER, x + 0.1, 0.01, "madvise", 384 << 20, flags=advice)
    s.oncpu_every(TRAINER, 0.0, 10.0, hz=100, kstack=lambda ts: FAULT_STACK if (ts % 0.15) < 0.1 else None)
    s.gpu_series(lambda ts: 3.0)
    assert top(analyze(s.read(tmp_path))).category == category


def test_one_big_allocation_is_page_faults_not_churn(tmp_path):
    """The same faults on one buffer mapped once and kept: page faults, not churn."""
    s = Synth()
    s.thread(TRAINER, "python")
    s.mm_syscall(TRAINER, 0.0, 0.0001, "mmap", 4 << 30)
    for x in periodic(0.0, 10.0, 0.15):
        s.faults(TRAINER, x, 0.1, (384 << 20) // 4096)
    s.oncpu_every(TRAINER, 0.0, 10.0, hz=100, kstack=lambda ts: FAULT_STACK if (ts % 0.15) < 0.1 else None)
    s.gpu_series(lambda ts: 3.0)
    assert top(analyze(s.read(tmp_path))).category == "page_faults"


def test_page_faults(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    trainer_blocked_every(s, 0.2, 0.1, state="D", kstack=FAULT_IO_STACK)
    for x in periodic(0.0, 10.0, 0.1):
        s.faults(TRAINER, x, 0.1, 40)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "page_faults"
    assert f.share >= 0.95
    assert f.evidence["faults"] == 4000
    assert "filemap_fault" in f.evidence["kernel_stack"]
    check_shares(a)


def test_mmap_lock(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    s.thread(101, "python")
    for x in trainer_blocked_every(s, 0.2, 0.1, state="D"):
        s.mmap_lock(TRAINER, x - 0.0001, 0.1, state="read")
        s.mm_syscall(101, x - 0.001, 0.1, "munmap", 64 << 20)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "mmap_lock"
    assert f.share >= 0.95
    assert f.evidence["read_waits"] == 50
    check_shares(a)


def test_memory_reclaim(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    for i, x in enumerate(trainer_blocked_every(s, 0.2, 0.1, state="D", kstack=RECLAIM_STACK)):
        s.reclaim(TRAINER, x - 0.005, 0.104, pages=512, state="memcg")
        if i % 10 == 0:
            s.compaction(TRAINER, x + 0.099, 0.0005)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "memory_reclaim"
    assert f.share >= 0.95
    assert f.evidence["pages_reclaimed"] == 50 * 512
    assert f.evidence["compaction_events"] == 5
    check_shares(a)


def test_dirty_throttling(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    for x in trainer_blocked_every(s, 0.2, 0.1, state="D", kstack=DIRTY_STACK):
        s.dirty_pause(TRAINER, x, 0.1, dirty=60_000, limit=50_000)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "dirty_throttling"
    assert f.share >= 0.95
    assert f.evidence["dirty_pause_events"] == 50
    assert f.evidence["devices"] == ["nvme0n1"]
    check_shares(a)


def test_block_io(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    for x in trainer_blocked_every(s, 0.2, 0.1, state="D"):
        s.block_rq(TRAINER, x + 0.001, 0.098, size=1 << 20)
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "block_io"
    assert f.share >= 0.95
    assert f.evidence["bytes"] == 50 << 20
    check_shares(a)


def test_block_io_from_stack(tmp_path):
    s = Synth()
    s.thread(TRAINER, "python")
    trainer_blocked_every(s, 0.2, 0.1, state="D", kstack=BLOCK_STACK)
    s.gpu_from_running(TRAINER)
    assert top(analyze(s.read(tmp_path))).category == "block_io"


NUMA = {"nodes": {"0": [0, 1], "1": [2, 3]}, "gpus": [{"index": 0, "bus_id": "00000000:19:00.0", "node": 0}], "gpu_node": 0, "declared": True}


def test_numa_remote(tmp_path):
    s = input_pipeline(topology=NUMA)
    s.oncpu_every(WORKER, 0.0, 10.0, hz=99, cpu=2)  # the decoder runs on node 1
    s.oncpu_every(TRAINER, 0.0, 10.0, hz=20, cpu=0)
    s.numa_maps(10.0, 0, 1000)
    s.numa_maps(10.0, 1, 9000)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "numa_remote"
    assert f.share >= 0.9
    assert f.evidence["gpu_node"] == 0
    assert f.evidence["remote_threads"][0]["tid"] == WORKER
    assert f.evidence["memory_pages_by_node"] == {"0": 1000, "1": 9000}
    check_shares(a)


def test_numa_local_stays_input_pipeline(tmp_path):
    s = input_pipeline(topology=NUMA)
    s.oncpu_every(WORKER, 0.0, 10.0, hz=99, cpu=1)
    a = analyze(s.read(tmp_path))
    assert top(a).category == "input_pipeline"
    assert "numa_remote" not in set(a.findings["category"])


def test_other(tmp_path):
    """Sleeps no thread ended: without GPU samples they are the trainer's non-running
    time, `other`; with GPU samples they are what a blocking GPU synchronisation looks
    like, so they explain no idle time (reported as such, never a finding)."""
    s = Synth(gpu_source=None)
    s.thread(TRAINER, "python")
    trainer_blocked_every(s, 0.2, 0.1, state="S", kstack=SLEEP_STACK)
    a = analyze(s.read(tmp_path))
    assert a.basis == "trainer_not_running"
    f = top(a)
    assert f.category == "other"
    assert f.share >= 0.95
    assert f.severity != "critical"  # nothing to act on first

    s.meta["gpu"]["source"] = "nvidia-smi"
    s.gpu_from_running(TRAINER)
    a = analyze(s.read(tmp_path, "gpu.parquet"))
    assert a.basis == "gpu_idle"
    assert "other" not in set(a.findings["category"])
    # The GPU idles through every sleep (5 s) and 5% of the rest (0.25 s): the sleeps
    # could cover 5 s of it, which is said, not counted.  The rest fell while the trainer
    # ran (the samples alternate between running and sleeping): host-bound time.
    assert a.idle_ns == pytest.approx(5.25e9, rel=1e-3)
    assert a.unwoken_idle_ns == pytest.approx(5.0e9, rel=1e-3)
    assert a.starved_ns == pytest.approx(a.host_bound_ns) == pytest.approx(0.25e9, rel=1e-3)


def test_healthy_run_has_no_critical_finding(tmp_path):
    a = analyze(healthy().read(tmp_path))
    # the brief waits, inside 8% idle samples; the rest of the idle time is the trainer's
    # host work, under a tenth of the window: not critical
    assert a.starved_ns - a.host_bound_ns < 0.01 * a.window.ns
    assert a.host_bound_ns <= a.idle_ns
    assert not (a.findings["severity"] == "critical").any()


def test_healthy_run_without_gpu_has_no_critical_finding(tmp_path):
    a = analyze(healthy(gpu=False).read(tmp_path))
    assert a.basis == "trainer_not_running"
    assert a.starved_ns > 0  # the trainer's brief waits still count
    assert not (a.findings["severity"] == "critical").any()


def test_findings_columns_and_dtypes(tmp_path):
    a = analyze(input_pipeline().read(tmp_path))
    # Numbers and names only: the report layer writes the summary and recommendation.
    assert list(a.findings.columns) == ["category", "share", "seconds", "severity", "threads", "chain", "evidence", "launch_gap_s"]
    assert a.findings["share"].dtype == "float64"
    assert a.starved["category"].dtype == CATEGORY_DTYPE
    assert (a.findings["share"].diff().dropna() <= 0).all()  # sorted, largest first


def test_running_reclaim_is_known_exactly_from_reclaim_rows(tmp_path):
    """A trainer that never blocks but runs memcg reclaim 30 ms in every 100 ms, with no
    on-CPU sample to say so: the reclaim rows alone name that running time, and in
    samples half idle it is the starved time (30 of each 50 ms idle)."""
    s = Synth()
    s.thread(TRAINER, "python")
    for x in periodic(0.0, s.duration_s, 0.1):
        s.add("reclaim", ts_ns=t(x + 0.02), dur_ns=d(0.03), tid=TRAINER, pid=TRAINER, state="memcg", count=512)
    s.gpu_series(lambda ts: 50.0)
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "memory_reclaim"
    assert f.seconds == pytest.approx(3.0, rel=0.01)
    # the other 20 of each 50 ms idle: the trainer's user running time, host-bound
    assert a.host_bound_ns == pytest.approx(2.0e9, rel=0.01)
    assert f.share == pytest.approx(0.6, rel=0.01)
