"""Running a workload under the real recorder, for tests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from trainbpf.trace.reader import Trace, read_trace
from trainbpf.tracer.record import record
from trainbpf.tracer.record_config import RecordConfig
from trainbpf.tracer.record_output import RecordResult
from trainbpf.tracer.settings import Settings

WORKLOADS = Path(__file__).with_name("kernel_workloads.py")


@dataclass
class Recorded:
    trace: Trace
    result: RecordResult
    tids: dict  # what the workload reported
    pid: int


def record_workload(out: Path, name: str, *args, cgroup_procs: Path | None = None,
                    settings: Settings | None = None, timeout: float = 120,
                    command: list[str] | None = None, probes: list[str] | None = None) -> Recorded:
    """Start kernel_workloads.py NAME (or `command`, which speaks the same protocol),
    attach the recorder, let the workload run to its exit (which ends the recording),
    and load the trace."""
    proc = subprocess.Popen(command or [sys.executable, str(WORKLOADS), name, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        if cgroup_procs is not None:
            cgroup_procs.write_text(str(proc.pid))

        def go() -> None:
            proc.stdin.write("go\n")
            proc.stdin.flush()

        box: dict = {}

        def run() -> None:
            try:
                box["result"] = record(config=RecordConfig(pid=proc.pid, output=out, duration=timeout,
                                                                   settings=settings or Settings(), probes=probes, gpu="off"),
                                       handle_signals=False, on_attached=go)
            except BaseException as exc:  # re-raised in the test thread
                box["error"] = exc
                proc.kill()  # never told to go: its report would never come

        t = threading.Thread(target=run)
        t.start()
        line = proc.stdout.readline()
        proc.wait(timeout=timeout)
        t.join(timeout=timeout)
        if "error" in box:
            raise box["error"]
        tids = json.loads(line) if line.strip() else {}
        return Recorded(read_trace(out), box["result"], tids, proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def record_cli(folder: Path, probes: str, pid: int) -> str:
    """`trainbpf record` of process `pid` for a second with `probes`: what it says on stderr."""
    trainbpf = Path(sys.executable).with_name("trainbpf")
    res = subprocess.run([str(trainbpf), "record", "--pid", str(pid), "--duration", "1", "--gpu", "off",
                          "--probes", probes, "-o", str(folder / f"{pid}.parquet")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stderr
