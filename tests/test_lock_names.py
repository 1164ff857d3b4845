"""A lock finding names its lock and the threads that held it (docs/findings.md,
lock_contention): glibc's malloc arena, a Python lock, or the mapping and address; the
holders with their Python frames; and the advice that follows the lock's kind."""

from __future__ import annotations

from synth import TRAINER
from test_analyze_findings import LOCK_ADDR, round_robin_lock, top
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, recommendation

MAIN_ARENA = "main_arena+0x0 [libc.so.6]"
# Native user stacks as the recorder walks them: glibc has no frame pointers, so a
# waiter's walk usually stops in the lock routine.
LLL_USTACK = ("__lll_lock_wait_private [libc.so.6]",)
ARENA_USTACK = ("__lll_lock_wait_private [libc.so.6]", "_int_free_merge_chunk [libc.so.6]", "free [libc.so.6]",
                "arena_churn [libarena_churn.so]", "ffi_call_unix64 [libffi.so.8]")
PY_LOCK_USTACK = ("__futex_abstimed_wait_common [libc.so.6]", "do_futex_wait [libc.so.6]",
                  "PyThread_acquire_lock_timed [python3.11]", "acquire_timed [python3.11]",
                  "lock_PyThread_acquire_lock [python3.11]", "_PyEval_EvalFrameDefault [python3.11]")
# Each thread's Python stack, leaf first.
PYSTACKS = {
    TRAINER: ("step (/srv/train.py:42)", "main (/srv/train.py:80)"),
    101: ("churn (/srv/workers.py:17)", "Thread.run (/usr/lib/python3.11/threading.py:975)"),
    102: ("encode (/srv/workers.py:30)", "Thread.run (/usr/lib/python3.11/threading.py:975)"),
}


def lock_finding(tmp_path, s):
    a = analyze(s.read(tmp_path))
    f = top(a)
    assert f.category == "lock_contention"
    return f, Report.of(a).doc["findings"][0]


def test_lock_in_main_arena_is_glibcs_malloc_arena_with_its_holders(tmp_path):
    s = round_robin_lock(LLL_USTACK, pystacks=PYSTACKS)
    s.futex_addr(LOCK_ADDR, MAIN_ARENA)
    f, doc = lock_finding(tmp_path, s)
    assert f.evidence["case"] == "malloc_arena"
    assert f.evidence["lock"] == {"kind": "malloc_arena", "name": f"glibc malloc arena ({MAIN_ARENA})"}
    # In turn, 102 holds the lock just before the trainer: its unlocks end every wait.
    [holder] = f.evidence["holders"]
    assert holder["tid"] == 102
    assert holder["function"] == "workers.py:30 encode"
    assert holder["python"][0] == {"function": "encode", "file": "/srv/workers.py", "line": 30}
    lock = [c for c in doc["culprits"] if c["kind"] == "lock"]
    assert lock == [{"kind": "lock", "name": f"glibc malloc arena ({MAIN_ARENA})", "address": hex(LOCK_ADDR),
                     "lock_kind": "malloc_arena"}]
    named = {c["tid"]: c.get("function") for c in doc["culprits"] if c.get("holder")}
    assert named == {102: "workers.py:30 encode"}
    assert "glibc's malloc arena lock (main_arena+0x0 [libc.so.6])" in doc["summary"]
    assert "held by python (102) in workers.py:30 encode" in doc["summary"]
    assert "LD_PRELOAD=libjemalloc.so.2" in doc["recommendation"]
    assert "glibc.malloc.arena_max" in doc["recommendation"]
    assert "if the lock is the allocator's" not in doc["recommendation"]


def test_lock_in_anonymous_memory_waited_for_inside_malloc_is_an_arena(tmp_path):
    """Arenas other than main_arena live in anonymous mappings: the waiters' allocator
    frames tell."""
    s = round_robin_lock(ARENA_USTACK)
    s.futex_addr(LOCK_ADDR, "[anon]", region="anon")
    f, doc = lock_finding(tmp_path, s)
    assert f.evidence["case"] == "malloc_arena"
    assert f.evidence["lock"]["name"] == f"glibc malloc arena (an arena at {hex(LOCK_ADDR)})"
    assert doc["recommendation"] == recommendation("lock_contention", f.evidence)
    assert "LD_PRELOAD=libjemalloc.so.2" in doc["recommendation"]


def test_python_lock_is_named_by_the_frame_that_took_it(tmp_path):
    s = round_robin_lock(PY_LOCK_USTACK, pystacks=PYSTACKS)
    s.futex_addr(LOCK_ADDR, "[heap]", region="heap")
    f, doc = lock_finding(tmp_path, s)
    assert f.evidence["case"] == "python_lock"
    assert f.evidence["lock"] == {"kind": "python_lock", "name": "Python lock taken at train.py:42 step"}
    assert "Python lock taken at train.py:42 step" in doc["summary"]
    assert "`with lock:`" in doc["recommendation"]


def test_unknown_lock_is_named_by_its_mapping_and_keeps_the_general_advice(tmp_path):
    s = round_robin_lock(LLL_USTACK)
    s.futex_addr(LOCK_ADDR, "[heap]", region="heap")
    f, doc = lock_finding(tmp_path, s)
    assert "case" not in f.evidence
    assert f.evidence["lock"] == {"kind": "mapping", "name": f"lock at {hex(LOCK_ADDR)} in [heap]"}
    assert [c["name"] for c in doc["culprits"] if c["kind"] == "lock"] == [f"lock at {hex(LOCK_ADDR)} in [heap]"]
    assert "if the lock is the allocator's" in doc["recommendation"]
    # Without Python stacks in the trace, holders are named by thread alone.
    assert all("function" not in h for h in f.evidence["holders"])
