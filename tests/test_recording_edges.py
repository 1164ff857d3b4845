"""Recording edge cases from issue 15: options refused before anything is compiled (M5),
a thread group followed until its last thread ends (D4), the recorder never tracing
itself (--pid 1), and a killed recording's open intervals and duration (D3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kernel_env import require_root
from trainbpf.errors import EnvironmentCheckError, UsageError
from trainbpf.tracefile import read_trace
from trainbpf.tracer.record import record

TRAINBPF = str(Path(sys.executable).with_name("trainbpf"))


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINBPF, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=180, **kw)


def one_line_error(res: subprocess.CompletedProcess, code: int, words: str) -> None:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == code and len(lines) == 1, (res.returncode, res.stderr)
    assert lines[0].startswith("trainbpf: error: ") and words in lines[0], lines[0]


# -- M5: bad option values, refused at once ----------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--oncpu-hz", "0"], "--oncpu-hz"),  # was exit 12 "run doctor" after compiling the probes
    (["--oncpu-hz", "-1"], "--oncpu-hz"),
    (["--duration", "nan"], "--duration"),  # was a recording that never stopped
    (["--min-block-us", "-5"], "--min-block-us"),  # were accepted
    (["--min-futex-us", "nan"], "--min-futex-us"),
    (["--min-lock-us", "-1"], "--min-lock-us"),
])
def test_bad_values_are_refused_before_anything_runs(args, words, tmp_path):
    start = time.monotonic()
    res = cli("record", "--pid", str(os.getpid()), "-o", str(tmp_path / "t.parquet"), *args)
    one_line_error(res, UsageError.exit_code, words)
    assert time.monotonic() - start < 20, "refused only after compiling the probes"
    assert not list(tmp_path.iterdir())


def test_gpu_nvml_without_nvml_and_a_foreign_trainer_tid_are_refused(tmp_path):
    require_root()
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        pytest.skip("NVML loads on this machine")
    except Exception:
        pass
    target = subprocess.Popen(["sleep", "30"])
    try:
        res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"), "-d", "1", "--gpu", "nvml")
        one_line_error(res, EnvironmentCheckError.exit_code, "--gpu nvml")  # was: recorded without GPU samples
        res = cli("record", "--pid", str(target.pid), "-o", str(tmp_path / "t.parquet"), "-d", "1",
                  "--trainer-tid", "1")
        one_line_error(res, UsageError.exit_code, "--trainer-tid 1")  # was: accepted
    finally:
        target.kill()
        target.wait()
    assert not list(tmp_path.iterdir())
