"""The tracers bench_overhead.py compares, each attached to the workload's process before
its steps start and detached after they end: trainbpf as shipped and in its like-for-like
variants (scripts/bench_overhead.py's docstring says which), another revision's recorder,
bcc's offcputime-bpfcc, offcputime's method on the sched_switch tracepoint
(offcputime_tp.*) and `perf sched record`."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import time
from pathlib import Path

import benchlib as bl

TRAINBPF = "trainbpf (every probe, Python frames included)"
TRAINBPF_SCHED = "trainbpf, sched probe only, --no-python-frames"
TRAINBPF_NO_PYTHON = "trainbpf (every probe, --no-python-frames)"
OFFCPUTIME = "offcputime-bpfcc"
OFFCPU_PORT = "offcputime method on sched_switch tracepoint (offcputime-bpfcc itself needs kprobes)"
PERF_SCHED = "perf sched record"
ATTACH_TIMEOUT_S = 120
SETTLE_S = 2.0


class Tracer:
    """Attaches to a process before its steps start; detaches after they end."""

    name: str

    def start(self, pid: int, out: Path) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        """The tracer's own process, whose CPU counts as overhead."""
        return self.proc.pid

    def stop(self) -> dict:
        return {}


class Trainbpf(Tracer):
    """The recorder as shipped: every probe, the defaults (Python frames on)."""

    name = TRAINBPF
    probes: list[str] | None = None  # every probe
    settings: dict = {}

    def start(self, pid: int, out: Path) -> None:
        self.rec = bl.Recording(pid=pid, output=out / "trace.parquet", probes=self.probes,
                                settings=self.settings).start(ATTACH_TIMEOUT_S)
        self.proc = self.rec.proc

    def stop(self) -> dict:
        result = self.rec.stop()
        return {"rows": result["rows"], "lost": sum(result["lost"].values()), "bytes": result["bytes"],
                "faults": result.get("faults") or {}}


class TrainbpfAt(Trainbpf):
    """Another revision's recorder (bl.revision_package), every probe: before/after in one run."""

    def __init__(self, rev: str, pythonpath: Path):
        self.name = f"trainbpf at {rev} (every probe)"
        self.pythonpath = str(pythonpath)

    def start(self, pid: int, out: Path) -> None:
        self.rec = bl.Recording(pid=pid, output=out / "trace.parquet", pythonpath=self.pythonpath)
        self.rec.start(ATTACH_TIMEOUT_S)
        self.proc = self.rec.proc


class TrainbpfNoPython(Trainbpf):
    """Every probe without the CPython frame walk (probes/pyframes.h): what the walk adds."""

    name = TRAINBPF_NO_PYTHON
    settings = {"python_frames": False}


class TrainbpfSched(Trainbpf):
    """The probe that records what offcputime records (off-CPU intervals with native
    stacks: offcputime walks no Python frames)."""

    name = TRAINBPF_SCHED
    probes = ["sched"]
    settings = {"python_frames": False}


class _Process(Tracer):
    """A tracer that is a command; attached once it prints `attached` (or after a grace
    period for tools that print nothing)."""

    grace_s = 0.0

    def argv(self, pid: int, out: Path) -> list[str]:
        raise NotImplementedError

    def start(self, pid: int, out: Path) -> None:
        self.proc = subprocess.Popen(self.argv(pid, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=bl.bcc_env())
        if self.grace_s:
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                return  # still running: attached
            raise TracerFailed(failure_line(self.proc.stderr.read()))
        line = bl.readline(self.proc, ATTACH_TIMEOUT_S)
        if line.strip() != "attached":
            self.proc.kill()
            raise TracerFailed(failure_line(self.proc.stderr.read() or line))

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=300)
        return {}


class OffcputimePort(_Process):
    name = OFFCPU_PORT

    def argv(self, pid: int, out: Path) -> list[str]:
        return [bl.python(), str(bl.BENCH / "offcputime_tp.py"), "--pid", str(pid), "--output", str(out / "folded.txt")]


COST_TOOLS = {"every": Trainbpf, "no-python": TrainbpfNoPython, "sched": TrainbpfSched, "port": OffcputimePort}


class Offcputime(_Process):
    """bcc's own tool.  It prints nothing until it ends, so it counts as attached once it
    has outlived its compile (and has not failed)."""

    name = OFFCPUTIME
    grace_s = 30.0

    def argv(self, pid: int, out: Path) -> list[str]:
        return ["offcputime-bpfcc", "-f", "-p", str(pid)]


class PerfSched(Tracer):
    name = PERF_SCHED

    def start(self, pid: int, out: Path) -> None:
        self.data = out / "perf.data"
        self.proc = subprocess.Popen(["perf", "sched", "record", "-o", str(self.data), "-p", str(pid)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # perf prints nothing on attach; it needs well under a second here
        if self.proc.poll() is not None:
            raise TracerFailed(failure_line(self.proc.stderr.read()))

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=300)
        return {"bytes": self.data.stat().st_size if self.data.exists() else 0}


class TracerFailed(Exception):
    pass


def failure_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "exited without a message"


def kprobes_note() -> str:
    """Why kprobe-based tools cannot attach here, when the kernel config says so."""
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")):
        try:
            text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        except OSError:
            continue
        if "# CONFIG_KPROBES is not set" in text:
            return "this kernel is built without kprobes (# CONFIG_KPROBES is not set)"
    return ""


def settle() -> None:
    """The same start for every run: the previous run's checkpoints written back, the
    previous tracer's exit done with (else whichever run comes right after another is
    slower: untraced runs, which have no attach to wait for)."""
    os.sync()
    time.sleep(SETTLE_S)

