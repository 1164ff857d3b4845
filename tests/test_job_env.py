"""Job discovery (issue 28, item 1): each traced process's rank variables, read from its
environment when it is seeded, forked and exec'd (`process_env` rows), the target's rank
in the metadata's `job`, and the note `record --pid RANK_PID` prints.  Nothing else of an
environment reaches the trace (docs/security.md)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kernel_env import require_root
from trainbpf.trace.reader import read_trace
from trainbpf.tracer.collector import ThreadTable
from trainbpf.tracer.samplers import jobenv
from trainbpf.tracer.samplers.jobenv import (
    JobEnvReader,
    lone_rank_note,
    parse_environ,
    rank_of,
    read_environ,
)
from trainbpf.tracer.proctree import cmdline, process_tree
from trainbpf.tracer.record import Recorder
from trainbpf.tracer.record_config import RecordConfig
from trainbpf.tracer.settings import Settings

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))


# -- the parser -------------------------------------------------------------------------

def test_only_the_job_variables_are_kept():
    raw = b"\0".join([b"HOME=/root", b"RANK=1", b"AWS_SECRET_ACCESS_KEY=hunter2", b"WORLD_SIZE=4",
                      b"rank=9", b"RANKX=3", b"XRANK=3", b"SLURM_JOB_ID=77", b"MASTER_PORT=29500", b""])
    assert parse_environ(raw) == {"RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "29500", "SLURM_JOB_ID": "77"}
    assert list(parse_environ(raw)) == ["RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_JOB_ID"]  # JOB_VARIABLES order


def test_a_long_value_is_cut_at_256_characters():
    env = parse_environ(b"TORCHELASTIC_RUN_ID=" + b"a" * 5000 + b"\0RANK=0")
    assert env == {"TORCHELASTIC_RUN_ID": "a" * 256, "RANK": "0"}


def test_bytes_that_are_not_utf8_and_controls_are_escaped_within_the_cut():
    env = parse_environ(b"MASTER_ADDR=h\xe9\xff\x1b[2J\0NODE_RANK=n" + "\u00e9".encode())
    assert env["MASTER_ADDR"] == "h\\xe9\\xff\\x1b[2J" and env["NODE_RANK"] == "n\u00e9", env
    cut = parse_environ(b"MASTER_ADDR=" + b"x" * 254 + b"\xff\xff")["MASTER_ADDR"]
    assert cut == "x" * 254, "an escape is never cut in half"  # "\xff" is 4 characters: it does not fit


def test_entries_without_equals_are_skipped_and_the_first_of_a_name_counts():
    assert parse_environ(b"RANK\0WORLD_SIZE\0RANK=2\0RANK=3\0=5\0LOCAL_RANK=") == {"RANK": "2", "LOCAL_RANK": ""}


@pytest.mark.parametrize("env, want", [
    ({"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16"}, (5, 16)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2)),
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, (0, 4)),
    ({"PMIX_RANK": "2"}, (2, None)),
    ({"RANK": "1", "SLURM_PROCID": "7"}, (1, None)),  # torchrun's own under Slurm
    # mpirun's ranks inside a Slurm step: the launcher's variable, as the analysis reads it
    ({"OMPI_COMM_WORLD_RANK": "3", "SLURM_PROCID": "0", "OMPI_COMM_WORLD_SIZE": "4", "SLURM_NTASKS": "1"}, (3, 4)),
    ({"RANK": "one", "WORLD_SIZE": "\u0663"}, (None, None)),  # not a decimal number
    ({"LOCAL_RANK": "0"}, (None, None)),
])
def test_rank_and_world_size_from_any_launcher(env, want):
    assert rank_of(env) == want


def test_the_note_only_for_one_rank_of_several_traced_alone():
    rank1 = {"RANK": "1", "WORLD_SIZE": "3"}
    assert lone_rank_note(40, rank1, [rank1, {}]) == (
        "note: pid 40 is rank 1 of 3; the other 2 ranks are not traced (record the launcher's pid to trace every rank)")
    assert lone_rank_note(40, {}, [rank1]) is None  # a launcher: its ranks are below it
    assert lone_rank_note(40, {"RANK": "0", "WORLD_SIZE": "1"}, []) is None  # a job of one
    # a Slurm batch shell is SLURM_PROCID 0 of the job while the tasks below it are the ranks
    shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert lone_rank_note(40, shell, [shell, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}]) is None


def _wait(what: str, ok, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _process(env: dict[str, str]) -> subprocess.Popen:
    """`sleep` with `env`, once its exec has laid out its arguments and environment (the
    kernel does that after Popen's exec pipe closes; until then environ reads empty)."""
    proc = subprocess.Popen(["sleep", "30"], env=env)
    # Until the exec the child is a fork of this test (its own arguments and environment):
    # wait for sleep's own arguments, then for its environment, whose end the kernel sets
    # after the arguments' (a read between the two is empty).
    _wait("the exec", lambda: cmdline(proc.pid)[:1] == ["sleep"])
    _wait("the environment", lambda: Path(f"/proc/{proc.pid}/environ").read_bytes() != b"")
    return proc


def test_the_environment_read_is_bounded():
    """/proc/PID/environ is read up to 1 MiB: a variable beyond is not seen."""
    filler = {f"FILLER{i}": "f" * (120 << 10) for i in range(10)}  # ~1.2 MiB before RANK
    late, early = _process({**filler, "RANK": "5"}), _process({"RANK": "5", **filler})
    try:
        assert read_environ(early.pid) == {"RANK": "5"}
        assert read_environ(late.pid) == {}
    finally:
        for p in (late, early):
            p.kill()
            p.wait()
    assert read_environ(late.pid) is None  # gone


def test_each_program_of_a_process_is_read_once(monkeypatch):
    reads: list[int] = []
    real = jobenv.read_environ
    monkeypatch.setattr(jobenv, "read_environ", lambda pid: reads.append(pid) or real(pid))
    proc = _process({"RANK": "2", "WORLD_SIZE": "4", "HOME": "/nowhere"})
    try:
        table, reader = ThreadTable(), JobEnvReader()
        table.tgid.update({proc.pid: proc.pid, proc.pid + 100_000: proc.pid})  # a second thread
        first = reader.take(table).to_pydict()
        assert (first["pid"], first["name"], first["state"]) == ([proc.pid] * 2, ["RANK", "WORLD_SIZE"], ["2", "4"])
        assert reader.take(table) is None and reads == [proc.pid], "read again with nothing new"
        table.exec_log.append((proc.pid, proc.pid, 0, "sleep"))  # an exec: read anew, the same variables
        assert reader.take(table) is None and reads == [proc.pid] * 2, "an unchanged environment written twice"
    finally:
        proc.kill()
        proc.wait()


# -- recorded: a launcher's tree ------------------------------------------------------------

# A launcher without rank variables: two ranks started (fork + exec) before the recording,
# then, once it runs, a child forked with the launcher's environment that execs its own
# program when told (on stdin) with another one.
LAUNCHER = r"""
import json, os, subprocess, sys, time
token = os.environ["TRAINBPF_TEST_SECRET"]  # never on a command line: the trace keeps the target's
def env(rank, run):
    return {"PATH": os.environ["PATH"], "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": run, "TRAINBPF_TEST_SECRET": token}
ranks = [subprocess.Popen(["sleep", "30"], env=env(r, "tb-run")) for r in (0, 1)]
print(json.dumps([p.pid for p in ranks]), flush=True)
sys.stdin.readline()
child = os.fork()
if child == 0:
    os.read(0, 16)
    os.execve("/bin/sleep", ["sleep", "30"], env(0, "tb-late"))
print(child, flush=True)
time.sleep(30)
"""


def _run(rec: Recorder, box: dict) -> None:
    """rec.run() as record() runs it, in a thread: its result or error in `box`."""
    try:
        box["result"] = rec.run()
    except BaseException as exc:  # re-raised in the test thread
        box["error"] = exc
    finally:
        if rec.out is not None:
            rec.out.close()


def _kill_tree(proc: subprocess.Popen) -> None:
    """`proc` and the processes it started (by their pids)."""
    for pid in reversed(process_tree(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _by_pid(rows) -> dict[int, list[dict]]:
    """process_env rows per pid: a list of {variable: value} per read, oldest first."""
    out: dict[int, list[dict]] = {}
    for (pid, ts), read in rows.groupby(["pid", "ts_ns"]):
        out.setdefault(int(pid), []).append(dict(zip(read["variable"], read["value"])))
    return out


def _job_env_reader(rec: Recorder, box: dict):
    """The recording's reader of the rank variables, once its sources are open."""
    _wait("the sources to open", lambda: any(s.name == "job_env" for s in rec.sources) or "error" in box)
    if "error" in box:
        raise box["error"]
    return next(s for s in rec.sources if s.name == "job_env").reader


def test_a_launchers_ranks_are_found_by_their_environment(tmp_path):
    """--pid LAUNCHER: each rank's RANK/WORLD_SIZE/TORCHELASTIC_RUN_ID, the launcher with
    none, a child forked while recording read again after its exec, no note, and the
    secret variable nowhere in the trace."""
    require_root()
    token = secrets.token_hex(16)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={"PATH": os.environ["PATH"], "MASTER_ADDR": "127.0.0.1",
                                                "MASTER_PORT": "29500", "TRAINBPF_TEST_SECRET": token})
    out, notices, box = tmp_path / "t.parquet", [], {}

    def go() -> None:
        launcher.stdin.write("go\n")
        launcher.stdin.flush()

    try:
        ranks = json.loads(launcher.stdout.readline())
        rec = Recorder(RecordConfig(pid=launcher.pid, output=out, duration=60, settings=Settings(), probes=("sched",),
                                    gpu="off"), on_attached=go, notice=notices.append)
        runner = threading.Thread(target=_run, args=(rec, box))
        runner.start()
        forked = int(launcher.stdout.readline())
        envs = _job_env_reader(rec, box).envs
        _wait("the forked child's first read", lambda: forked in envs or "error" in box)
        launcher.stdin.write("exec\n")
        launcher.stdin.flush()
        _wait("the read after its exec", lambda: "RANK" in envs.get(forked, {}) or "error" in box)
        rec.request_stop("done")
        runner.join(timeout=60)
    finally:
        _kill_tree(launcher)
    if "error" in box:
        raise box["error"]
    trace = read_trace(out)
    env = _by_pid(trace.view("process_env"))
    for rank, pid in enumerate(ranks):
        assert env[pid] == [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                             "TORCHELASTIC_RUN_ID": "tb-run"}], env.get(pid)
    assert env[launcher.pid] == [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}], "the launcher has no rank"
    assert env[forked] == [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},  # forked: the launcher's
                           {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "tb-late"}], env
    assert trace.meta["job"] == {"target_rank": None, "world_size": None}
    assert not [n for n in notices if n.startswith("note:")], notices
    assert token.encode() not in out.read_bytes(), "the secret variable is in the trace file"
    assert not [row for row in trace.table.to_pylist() if token in json.dumps(row)]


def test_record_pid_of_one_rank_says_the_others_are_not_traced(tmp_path):
    require_root()
    out = tmp_path / "t.parquet"
    # the rank, and a worker it forked (its environment too: the same rank)
    rank = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], env={"PATH": os.environ["PATH"], "RANK": "1",
                                                                  "WORLD_SIZE": "3", "LOCAL_RANK": "1"})
    try:
        res = subprocess.run([TRAINBPF, "record", "--pid", str(rank.pid), "-d", "1", "--probes", "sched",
                              "--gpu", "off", "-o", str(out)], capture_output=True, text=True, timeout=180)
    finally:
        _kill_tree(rank)
    assert res.returncode == 0, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: pid {rank.pid} is rank 1 of 3; the other 2 ranks are not traced "
                     "(record the launcher's pid to trace every rank)"], res.stderr
    trace = read_trace(out)
    assert trace.meta["job"] == {"target_rank": 1, "world_size": 3}
    env = _by_pid(trace.view("process_env"))
    assert len(env) == 2 and all(reads == [{"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3"}]
                                 for reads in env.values()), env
