"""Shared pieces of the benchmark scripts (scripts/bench_*.py): the machine description,
/proc measurements of other processes, a recorder run in its own process, per-program
in-kernel cost from BPF run-time statistics, paired-run ratios, and plain tables.

The benchmarks run as root from the repository's venv (scripts/setup.sh)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def bcc_env() -> dict[str, str]:
    """The environment for bcc tools run as commands: this process's, with the kernel
    headers chosen as the recorder chooses them (use_headers sets BCC_KERNEL_SOURCE to a
    merged tree, or unsets it where the running kernel's own headers are installed: bcc
    finds their build and source folders itself, and given only the build folder it
    misses the common headers and falls back to `modprobe kheaders`)."""
    from trainbpf.tracer.kheaders import use_headers

    use_headers()
    return dict(os.environ)


def python() -> str:
    """The venv interpreter (sees Debian's bcc), else this one."""
    return str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def require_root() -> None:
    if os.geteuid() != 0:
        sys.exit(f"{Path(sys.argv[0]).name}: run as root (BPF): sudo {python()} {' '.join(sys.argv)}")


# -- the machine ------------------------------------------------------------------------
def _first_line(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.splitlines()[0] if out else "?"


def machine() -> dict[str, str]:
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpus": str(os.cpu_count()),
        "cpu model": model,
        "memory": f"{mem_kib / 2**20:.1f} GiB",
        "kernel": platform.release(),
        "virtualisation": _first_line(["systemd-detect-virt"]),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def print_machine() -> None:
    print_table("machine", ["", ""], [[k, v] for k, v in machine().items()])


# -- other processes, from /proc --------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """CPU time of a process (all its threads, exited ones included), to the nanosecond:
    its CPU-time clock (clock_getcpuclockid's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)).
    /proc/PID/stat's utime + stime move in clock ticks (10 ms), as much as a whole
    tracer's CPU over one run of the benchmark."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:  # the process is gone: no clock to read
        raise FileNotFoundError(f"no process {pid}") from None


def rss_mib(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * PAGE_KIB / 1024


def context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches of every live thread of `pid`."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # the thread exited
        for line in text.splitlines():
            if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                total += int(line.split()[1])
    return total


def machine_busy_seconds() -> float:
    """CPU-seconds the whole machine has spent busy (not idle or in I/O wait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


def compile_c(source: Path, out_dir: Path) -> Path:
    exe = out_dir / source.stem
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", "-o", str(exe), str(source)], check=True)
    return exe


# -- a workload that waits for "go" ------------------------------------------------------
class Workload:
    """A process started paused: it prints nothing until it reads a line on stdin."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.pid = self.proc.pid

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        """The JSON line a workload prints when its timed part ends."""
        return json.loads(self.proc.stdout.readline())

    def finish(self, timeout: float = 600) -> str:
        out, _ = self.proc.communicate(timeout=timeout)
        if self.proc.returncode:
            raise RuntimeError(f"workload {self.proc.args} exited {self.proc.returncode}")
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# -- the recorder in its own process ------------------------------------------------------
@dataclass
class Recording:
    """`trainbpf record` of one process, run by bench/record_attached.py (the library
    call the CLI makes, plus a line on stdout once the probes are attached)."""

    pid: int
    output: Path
    settings: dict = field(default_factory=dict)
    probes: list[str] | None = None
    duration: float | None = None
    proc: subprocess.Popen | None = None
    result: dict | None = None
    peak_rss_mib: float = 0.0
    pythonpath: str | None = None  # another revision's package (revision_package), else this one

    def start(self, timeout: float = 180) -> "Recording":
        argv = [python(), str(BENCH / "record_attached.py"), "--pid", str(self.pid),
                "--output", str(self.output), "--settings", json.dumps(self.settings)]
        if self.probes:
            argv += ["--probes", ",".join(self.probes)]
        if self.duration:
            argv += ["--duration", str(self.duration)]
        env = {**os.environ, "PYTHONPATH": self.pythonpath} if self.pythonpath else None
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        line = readline(self.proc, timeout)
        if line.strip() != "attached":
            self.proc.kill()
            raise RuntimeError(f"recorder did not attach: {line!r}")
        return self

    @property
    def recorder_pid(self) -> int:
        return self.proc.pid

    def stop(self) -> dict:
        """Stop (SIGINT, as Ctrl-C) unless it stopped itself; the recorder's result.
        Also notes its peak RSS over its whole life (peak_rss_mib)."""
        os.kill(self.proc.pid, signal.SIGINT)  # not Popen.send_signal: its poll() would reap the process
        out = self.proc.stdout.read()
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss_mib = usage.ru_maxrss / 1024
        if self.proc.returncode:
            raise RuntimeError(f"recorder exited {self.proc.returncode}")
        self.result = json.loads(out.strip().splitlines()[-1])
        return self.result


def revision_package(rev: str, dest: Path) -> Path:
    """Git revision `rev` of the project laid out as the installed package (pyproject's
    package-dir), under `dest`: a PYTHONPATH that runs that revision's recorder."""
    import tomllib

    src, pkg = dest / "src", dest / "pkg"
    src.mkdir(parents=True)
    got = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
    if got.returncode != 0:  # a revision that does not exist, or a tree that is no git checkout
        why = got.stderr.decode(errors="replace").strip().splitlines()
        raise SystemExit(f"--baseline {rev}: git archive failed: {why[-1] if why else got.returncode}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=got.stdout, check=True)
    # That revision's own layout: its pyproject's package-dir (the folders it installs).
    layout = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(layout.items()):  # a package before its subpackages
        shutil.copytree(src / folder, pkg / package.replace(".", "/"), dirs_exist_ok=True)
    return pkg


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """A line of `proc`'s stdout, or a note when none comes within `timeout`."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        return f"(nothing in {timeout:.0f} s)"
    return proc.stdout.readline()


# -- in-kernel cost per program ------------------------------------------------------------
@contextmanager
def bpf_stats() -> Iterator[None]:
    """kernel.bpf_stats_enabled=1 for the duration, restored afterwards."""
    path = Path("/proc/sys/kernel/bpf_stats_enabled")
    before = path.read_text().strip()
    path.write_text("1")
    try:
        yield
    finally:
        path.write_text(before)


def program_names(pid: int) -> dict[int, str]:
    """prog_id -> what it is attached to (tracepoint or perf event), from bpftool."""
    try:
        out = subprocess.run(["bpftool", "perf", "show", "-j"], capture_output=True, text=True,
                             timeout=30).stdout
        rows = json.loads(out or "[]")
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for row in rows:
        if row.get("pid") == pid:
            names[row["prog_id"]] = row.get("tracepoint") or row.get("event") or row.get("fd_type", "?")
    return names


def program_stats(pid: int) -> dict[int, tuple[int, int]]:
    """prog_id -> (run_cnt, run_time_ns) of every BPF program `pid` holds open."""
    stats = {}
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            fields = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if "prog_id" in fields and "run_cnt" in fields:
            stats[int(fields["prog_id"])] = (int(fields["run_cnt"]), int(fields["run_time_ns"]))
    return stats


def program_name(prog_id: int) -> str:
    """A program's own name (for those attached other than to a tracepoint)."""
    try:
        out = subprocess.run(["bpftool", "prog", "show", "id", str(prog_id), "-j"], capture_output=True,
                             text=True, timeout=30).stdout
        return json.loads(out).get("name") or f"prog {prog_id}"
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return f"prog {prog_id}"


def kernel_cost_rows(pid: int) -> list[list[str]]:
    """Table rows: program, runs, total ms, ns per run; busiest first."""
    names = program_names(pid)
    rows = []
    for prog_id, (cnt, ns) in sorted(program_stats(pid).items(), key=lambda kv: -kv[1][1]):
        if cnt:
            name = names.get(prog_id) or program_name(prog_id)
            rows.append([name, str(cnt), f"{ns / 1e6:.1f}", f"{ns / cnt:.0f}"])
    return rows


# -- statistics and output ----------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f}" if values else "-"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n== {title}")
    for i, r in enumerate(cells):
        if i == 0 and not any(r):
            continue
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    sys.stdout.flush()


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
