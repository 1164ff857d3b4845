"""tracer.pycode names frames as CPython itself does: for every thread of real processes
of each version, the names and lines read from user space (the walk the kernel makes,
tracer.pyruntime.python_frames) equal what the process says of its own frames
(sys._current_frames()), frame by frame."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.kernel_env import PYTHON_VERSIONS, python_interpreter, require_root
from trainbpf.tracer.symbols import pycode, pyruntime

# Threads parked at known places: a lock wait in a nested function (GIL released), a
# method in time.sleep, a generator frame, and the main thread in a loop, reporting on
# the line it then sleeps on.
WORKLOAD = r'''
import json, sys, threading, time
gate = threading.Lock(); gate.acquire()
def decode_batch():
    def wait_for_data():
        gate.acquire()
    wait_for_data()
class Trainer:
    def train_step(self):
        time.sleep(60)
def gen():
    yield time.sleep(60)
ts = [threading.Thread(target=decode_batch), threading.Thread(target=Trainer().train_step),
      threading.Thread(target=lambda: next(gen()))]
for t in ts: t.start()
time.sleep(0.3)
def name(code):
    return getattr(code, "co_qualname", code.co_name)
def frames_of(frame):
    frames = []
    while frame is not None:
        frames.append([name(frame.f_code), frame.f_code.co_filename, frame.f_lineno])
        frame = frame.f_back
    return frames
def report(main_frame):
    truth = {threading.main_thread().native_id: frames_of(main_frame)}
    for ident, frame in sys._current_frames().items():
        if ident != threading.main_thread().ident:
            truth[next(t.native_id for t in ts if t.ident == ident)] = frames_of(frame)
    print(json.dumps(truth), flush=True)
for step in range(1000):
    report(sys._getframe()) if step == 0 else None; time.sleep(60)
'''

# x86-64 nanosleep, clock_nanosleep, pselect6: time.sleep's syscall (3.10: pselect6)
SLEEP_SYSCALLS = {35, 230, 270}


def _wait_asleep(pid: int) -> None:
    """Until the main thread is in time.sleep: its report is printed before the frames
    it describes are back to the loop's line."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        fields = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
        if fields[0].isdigit() and int(fields[0]) in SLEEP_SYSCALLS:
            return
        time.sleep(0.01)
    pytest.fail(f"the main thread of {pid} did not reach time.sleep")


@pytest.mark.kernel
@pytest.mark.parametrize("version", list(PYTHON_VERSIONS))
def test_names_and_lines_equal_the_process_own(version):
    require_root("reads another process's memory")
    proc = subprocess.Popen([python_interpreter(version), "-c", WORKLOAD], stdout=subprocess.PIPE, text=True)
    try:
        truth = {int(tid): frames for tid, frames in json.loads(proc.stdout.readline()).items()}
        _wait_asleep(proc.pid)
        py = pyruntime.attach(proc.pid)
        namer = pycode.CodeNamer(py)
        mem = pyruntime.ProcessMemory(proc.pid)
        try:
            for tid, frames in truth.items():
                walked = [namer.frame(code, instr) for code, instr in pyruntime.python_frames(mem, py.threads[tid], py.offsets)]
                assert walked == [f"{fn} ({file}:{line})" for fn, file, line in frames][:pyruntime.MAX_FRAMES]
            assert len(truth) == 4 and truth[proc.pid][0][0] == "<module>"
            assert any("wait_for_data" in f[0][0] for f in truth.values())
            assert namer.frame(py.threads[proc.pid], 0) is None  # a thread state is not a code object
            assert namer.frame(8, 0) is None  # nothing mapped there
        finally:
            mem.close()
            namer.close()
    finally:
        proc.kill()
        proc.wait()


def test_location_table_forms():
    """Each entry form of the 3.11+ location table moves the line as CPython's does."""
    table = bytes([
        0x80 | (13 << 3) | 0, 0x02,  # no columns, line +1 (svarint 2), 1 unit
        0x80 | (0 << 3) | 1, 0x00,  # short form, same line, 2 units
        0x80 | (12 << 3) | 0, 1, 2,  # one-line form, line +2
        0x80 | (15 << 3) | 2,  # no location, 3 units
        0x80 | (14 << 3) | 0, 0x03, 0, 1, 1,  # long form, line -1 (svarint 3)
    ])
    ends, lines = pycode.location_ranges(table, 10)
    assert ends == [1, 3, 4, 7, 8] and lines == [11, 11, 13, 0, 12]


def test_not_started_is_first_line():
    """An instruction index before the code (a frame not yet started) is co_firstlineno,
    as PyCode_Addr2Line answers; past the table is no line."""
    info = pycode.CodeInfo("f", "f.py", 7, *pycode.pep626_ranges(bytes([4, 1]), 7))
    assert (info.line(-1), info.line(0), info.line(1), info.line(2)) == (7, 8, 8, 0)


def test_pep626_table():
    """3.10: (bytecode delta, line delta) pairs; zero-width entries move the line only;
    -128 is no line."""
    table = bytes([0, 1, 4, 0, 2, 2, 6, 0x80, 2, 0xFF])
    ends, lines = pycode.pep626_ranges(table, 10)
    assert ends == [2, 3, 6, 7] and lines == [11, 13, 0, 12]
