"""`trainbpf health` target choice: device holders and launcher patterns in a process
table, the recorded tree, the live /proc scan, and threads born during the trace."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from synth import Synth
from trainbpf.health.config import HealthConfig
from trainbpf.health.targets import (
    Process,
    choose_targets,
    given_targets,
    recording_root,
    scan_processes,
    tree_tids,
)
from trainbpf.trace.errors import TargetError, UsageError


def _procs(*rows) -> dict[int, Process]:
    return {r[0]: Process(*r) for r in rows}


NODE = _procs(
    (1, 0, "systemd", "/sbin/init", False),
    (50, 1, "nvidia-persiste", "/usr/bin/nvidia-persistenced --user nvidia", True),
    (100, 1, "torchrun", "/usr/bin/python3 /usr/local/bin/torchrun --nproc-per-node 2 train.py", False),
    (101, 100, "python3", "/usr/bin/python3 -u train.py --local-rank 0", True),
    (102, 100, "python3", "/usr/bin/python3 -u train.py --local-rank 1", True),
    (103, 101, "pt_data_worker", "/usr/bin/python3 -u train.py --local-rank 0", True),  # forked: inherited fds
    (200, 1, "bash", "bash", False),
    (201, 200, "python3", "python3 -m torch.distributed.run --standalone cpu_train.py", False),
    (202, 201, "python3", "python3 cpu_train.py", False),
    (300, 1, "kworker/0:1", "", True),
    (400, 1, "sshd", "sshd: admin", False),
    (401, 400, "vim", "vim torchrunner.py", False),  # no word-bounded match
)


def test_ranks_are_the_topmost_device_holders_and_launchers_fold_into_them():
    targets = choose_targets(NODE, command_patterns=HealthConfig().command_patterns,
                             exclude_patterns=HealthConfig().exclude_patterns, skip=set())
    assert [(t.pid, t.reason) for t in targets] == [(101, "device"), (102, "device"), (201, "pattern")]


def test_the_check_itself_and_its_parents_are_never_targets():
    targets = choose_targets(NODE, command_patterns=(r"torch",), exclude_patterns=(), skip={400, 401})
    assert 401 not in {t.pid for t in targets}
    assert 50 in {t.pid for t in targets}, "without exclude patterns the daemon counts"


def test_given_pids_must_exist():
    assert [t.pid for t in given_targets(NODE, (102, 101, 102))] == [102, 101]
    with pytest.raises(TargetError, match="no such process: 999"):
        given_targets(NODE, (101, 999))


@pytest.mark.parametrize("pids, root", [([101], 101), ([101, 102], 100), ([103, 102], 100), ([101, 201], None), ([], None)])
def test_recording_root_is_the_deepest_common_ancestor(pids, root):
    assert recording_root(NODE, pids) == root


def test_scan_finds_a_holder_of_a_device_file(tmp_path):
    device = tmp_path / "fake-nvidia0"
    device.write_text("")
    pattern = str(tmp_path / "fake-nvidia*")
    with open(device):
        procs = scan_processes(device_glob=pattern)
        assert procs[os.getpid()].holds_device
    assert not any(p.holds_device for pid, p in procs.items() if pid != os.getpid())
    assert not scan_processes(device_glob=pattern)[os.getpid()].holds_device, "closed: no longer held"
    assert not scan_processes(device_glob=str(tmp_path / "nothing*"))[os.getpid()].holds_device


def test_scan_reads_names_and_command_lines_that_are_not_utf8():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", b"data-\xff\xfe.bin"])
    try:
        deadline = time.monotonic() + 10
        while True:  # until the child has exec'd python with its arguments
            procs = scan_processes(device_glob="/nonexistent*")
            if child.pid in procs and "data-" in procs[child.pid].cmdline or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert procs[child.pid].cmdline.endswith("time.sleep(60) data-\ufffd\ufffd.bin")
        assert procs[child.pid].ppid == os.getpid()
    finally:
        child.kill()
        child.wait()


def test_tree_tids_follows_processes_born_during_the_trace(tmp_path):
    s = Synth(duration_s=5.0)
    s.thread(10, "trainer", pid=10)
    s.thread(11, "worker-thread", pid=10, name="thread", ts=1.0, parent=10)
    s.thread(20, "child", pid=20, name="process", ts=2.0, parent=11)
    s.thread(21, "child-thread", pid=20, name="thread", ts=3.0, parent=20)
    s.thread(30, "stranger", pid=30, name="process", ts=2.0, parent=1)
    threads = s.read(tmp_path).frame("thread")
    assert tree_tids(threads, pids={10}, tids={10}) == {10, 11, 20, 21}
    assert tree_tids(threads, pids={30}, tids=set()) == {30}


def test_device_glob_over_proc_fds_is_bounded_and_tolerates_each_entry(tmp_path, monkeypatch):
    """issue 34 item 6: a file the pattern names that cannot be resolved (another
    process's /proc/PID/fd/N: EACCES) is left out, not a traceback; a pattern naming
    more files than any GPU node has is a one-line error, not a walk of every fd."""
    import trainbpf.health.targets as targets

    for i in range(6):
        (tmp_path / f"dev{i}").write_text("")
    realpath = os.path.realpath

    def denied(path, **kwargs):
        if str(path).endswith("dev3"):
            raise PermissionError(13, "Permission denied", str(path))
        return realpath(path, **kwargs)

    monkeypatch.setattr(os.path, "realpath", denied)
    with open(tmp_path / "dev3"), open(tmp_path / "dev4"):
        procs = scan_processes(device_glob=str(tmp_path / "dev*"))
    assert procs[os.getpid()].holds_device  # dev4, dev3 being unreadable
    scan_processes(device_glob="/proc/1/fd/*")  # init's descriptors: EACCES for root too where it may not ptrace
    monkeypatch.setattr(targets, "MAX_DEVICE_FILES", 5, raising=False)
    with pytest.raises(UsageError) as err:
        scan_processes(device_glob=str(tmp_path / "dev*"))
    assert str(err.value) == (f"device_glob '{tmp_path}/dev*' names more than 5 files; name the GPU device files "
                              "(default /dev/nvidia*)")
