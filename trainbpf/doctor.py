"""`trainbpf doctor`: can this machine record, and if not, what to do about it.

Each check gives a status (ok / warn / fail), what it found, and a fix hint.  The checks
`record` also runs before it compiles anything (and stops at the first failure, with one
line pointing here) live in tracer/preflight.py.  With a process id, doctor also lists
the CUDA libraries each process of its tree maps and the probed symbols they export:
what `record --pid` would probe (cuda_report)."""

from __future__ import annotations

import ctypes
import os
import shutil
import textwrap
from pathlib import Path
from typing import Callable

from trainbpf.trace.errors import TargetError, TrainbpfError
from trainbpf.tracer.preflight import (
    CAP_BPF,
    CAP_SYS_ADMIN,
    ENVIRONMENT,
    FAIL,
    OK,
    WARN,
    Check,
    check_privileges,
    effective_caps,
)

def check_bpf_syscall() -> Check:
    """Create (and close) a one-entry BPF array map through the raw syscall."""
    if os.geteuid() != 0 and not effective_caps() & (1 << CAP_BPF | 1 << CAP_SYS_ADMIN):
        return Check("bpf syscall", WARN, "not checked without privileges", "run doctor with sudo")
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 32)()
    attr[0], attr[1], attr[2], attr[3] = 2, 4, 8, 1  # BPF_MAP_TYPE_ARRAY, key 4, value 8, 1 entry
    nr_bpf = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine, 321)
    fd = libc.syscall(nr_bpf, 0, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        err = ctypes.get_errno()
        return Check("bpf syscall", FAIL, f"bpf(BPF_MAP_CREATE) failed: {os.strerror(err)}",
                     "the kernel needs CONFIG_BPF_SYSCALL; in containers allow the bpf syscall")
    os.close(fd)
    return Check("bpf syscall", OK, "BPF maps can be created")


def check_tracepoints() -> list[Check]:
    from trainbpf.tracer.loader import (
        ALL_COLLECTORS,
        TRACEFS,
        raw_tracepoint_exists,
        tracepoint_exists,
    )

    out = []
    for c in ALL_COLLECTORS:
        if c.uprobes or c.source is None:  # needs no tracepoint: check_uprobes, check_fault_counters
            continue
        missing = [tp for tp in c.tracepoints if not tracepoint_exists(tp, TRACEFS)]
        optional = [tp for tp in c.optional_tracepoints if not tracepoint_exists(tp, TRACEFS)]
        optional += [tp for tp in c.optional_raw_tracepoints if not raw_tracepoint_exists(tp)]
        if missing:
            out.append(Check(f"tracepoints: {c.name}", FAIL, "missing " + ", ".join(missing),
                             "a kernel built with these tracepoints (CONFIG_FTRACE_SYSCALLS etc.) "
                             f"or record with --probes excluding {c.name}"))
        elif optional:
            out.append(Check(f"tracepoints: {c.name}", WARN, "optional missing " + ", ".join(optional),
                             "recorded without them"))
        else:
            n = len(c.tracepoints) + len(c.optional_tracepoints) + len(c.optional_raw_tracepoints)
            out.append(Check(f"tracepoints: {c.name}", OK, f"{n} present" if n else "perf event (CPU clock)"))
    return out


def check_fault_counters() -> Check:
    """The faults probe reads each thread's counters in /proc and takes a thread's last
    ones from its taskstats exit message (tracer/collectors/faults.py)."""
    import threading

    from trainbpf.tracer.collectors.faults import ExitListener, read_faults

    if read_faults(f"/proc/self/task/{threading.get_native_id()}/stat") is None:
        return Check("fault counters", FAIL, "per-thread fault counters unreadable in /proc/PID/task/TID/stat",
                     "mount /proc, or record with --probes excluding faults")
    try:
        ExitListener().close()
    except Exception as exc:
        return Check("fault counters", WARN, f"per-thread counters in /proc; no taskstats exit messages ({exc})",
                     "a kernel with CONFIG_TASKSTATS; without it a thread's faults after its last read "
                     "(at most 100 ms) are not counted")
    return Check("fault counters", OK, "per-thread counters in /proc, a thread's last ones from taskstats at its exit")


def check_uprobes() -> Check:
    from trainbpf.tracer.loader import TRACEFS

    if Path("/sys/bus/event_source/devices/uprobe").is_dir() or (TRACEFS / "uprobe_events").exists():
        return Check("uprobes", OK, "supported: CUDA and NCCL probing available; `record` finds libcudart/libcuda "
                                    "and libnccl in each traced process's maps as it runs (`doctor --pid PID` "
                                    "lists the CUDA ones now)")
    return Check("uprobes", WARN, "no uprobe PMU and no uprobe_events",
                 "a kernel with CONFIG_UPROBE_EVENTS; without it CUDA and NCCL calls are not traced, the rest works")


def check_uprobe_attach(bpf) -> Check:
    """Attach the cuda probe's entry program to libc's getppid (never a traced thread's,
    so it records nothing) and detach it: what attaching to libcudart needs."""
    try:
        bpf.attach_uprobe(name="c", sym="getppid", fn_name="enter_cudaDeviceSynchronize")
        bpf.detach_uprobe(name="c", sym="getppid")
    except Exception as exc:  # bcc raises bare Exception
        return Check("uprobes attach", WARN, f"attaching a uprobe to libc failed: {exc}",
                     "CUDA calls will not be traced; the rest works")
    return Check("uprobes attach", OK, "a uprobe attached to libc's getppid and detached")


def check_gpu() -> Check:
    from trainbpf.tracer.samplers.nvml import NvmlSource

    # pynvml is always installed; NVML answers only where the driver's library loads.
    nvml = NvmlSource()
    if nvml.open():
        detail = f"NVML: {len(nvml.gpus)} GPU(s), " + (
            "the driver's own samples" if nvml.sampling == "driver_samples" else "utilisation rates (no driver samples)")
        nvml.close()
        return Check("gpu sampling", OK, detail)
    smi = shutil.which("nvidia-smi")
    if smi:
        return Check("gpu sampling", OK, f"nvidia-smi at {smi}")
    return Check("gpu sampling", WARN, "no nvidia-smi and no NVML",
                 "without GPU samples starved time is the trainer's non-running time")


def check_delayacct() -> Check:
    from trainbpf.tracer.samplers.taskstats import delayacct_enabled

    if delayacct_enabled():
        return Check("delay accounting", OK, "kernel.task_delayacct=1")
    return Check("delay accounting", WARN, "kernel.task_delayacct=0 (taskstats delays read as 0)",
                 "sudo sysctl kernel.task_delayacct=1")


def check_psi() -> Check:
    if Path("/proc/pressure/cpu").exists():
        return Check("pressure (PSI)", OK, "/proc/pressure present")
    return Check("pressure (PSI)", WARN, "PSI disabled", "boot with psi=1")


def check_probes_load() -> list[Check]:
    """The real test: compile and load every probe, attach a uprobe, then detach."""
    if os.geteuid() != 0:
        return [Check("probes load", WARN, "not tried without root", "run doctor with sudo")]
    from trainbpf.tracer import loader
    from trainbpf.tracer.settings import Settings

    try:
        bpf = loader.load(loader.select(list(loader.PROBE_NAMES), Settings()), Settings())  # the opt-in ones too
    except TrainbpfError as exc:
        return [Check("probes load", FAIL, str(exc).replace("; run `trainbpf doctor`", ""),
                      "see the checks above")]
    try:
        uprobe = check_uprobe_attach(bpf)
    finally:
        bpf.cleanup()
    return [Check("probes load", OK, f"all {len(loader.ALL_COLLECTORS)} probes compiled, loaded and detached"), uprobe]


# Names of the checks whose own name says less (the rest: the function's name).
_CHECK_NAMES = {"check_headers": "kernel headers", "check_gpu": "gpu sampling", "check_delayacct": "delay accounting",
                "check_psi": "pressure (PSI)"}


def _unseen(check: Callable[[], Check | list[Check]]) -> list[Check]:
    """`check`'s result; what it cannot see without root (tracefs, a root-only file)
    is a warning that says so, not a traceback."""
    try:
        result = check()
    except PermissionError as exc:
        name = _CHECK_NAMES.get(check.__name__, check.__name__.removeprefix("check_").replace("_", " "))
        fix = "run doctor with sudo" if os.geteuid() else "make it readable by root"
        return [Check(name, WARN, f"not checked: {exc.filename or exc.strerror} is not readable by this user", fix)]
    return result if isinstance(result, list) else [result]


def run_checks(*, load_probes: bool = True) -> list[Check]:
    checks = [check_privileges()]
    for check in (check_bpf_syscall, *ENVIRONMENT, check_tracepoints, check_fault_counters, check_uprobes, check_gpu,
                  check_delayacct, check_psi):
        checks += _unseen(check)
    if load_probes and not any(c.status == FAIL for c in checks):
        checks += check_probes_load()
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check'.ljust(width)}  status  detail"]
    for c in checks:
        lines.append(f"{c.name.ljust(width)}  {c.status.upper():6}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{''.ljust(width)}          fix: {c.fix}")
    failed = [c.name for c in checks if c.status == FAIL]
    lines.append("")
    lines.append(f"recording cannot work: {', '.join(failed)}" if failed else "recording can work on this machine")
    return "\n".join(lines)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


Exported = list[tuple[str, str]] | str  # (symbol, call) pairs, or why they could not be read


def process_cuda(pid: int, probed: dict[tuple[str, int], Exported] | None = None) -> list[tuple[str, Exported]] | str:
    """(path, exported) of each CUDA library process `pid` maps: the probed symbols it
    exports (tracer.cuda.exported_calls, read through the mapped file itself as `record`
    does: addrs.open_mapped) or why they could not be read; or why the maps could not be
    read.  `probed` caches the symbols per library file (device, inode) across processes."""
    from trainbpf.tracer.collectors.cuda import cuda_mappings, exported_calls
    from trainbpf.tracer.symbols.maps import open_mapped

    probed = {} if probed is None else probed
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError as exc:
        return f"maps not readable ({exc.strerror or exc}{'; run doctor with sudo' if os.geteuid() else ''})"
    out = []
    for m in cuda_mappings(maps):
        if m.file not in probed:
            try:
                fd = open_mapped(pid, m)
                try:
                    probed[m.file] = exported_calls(f"/proc/self/fd/{fd}")
                finally:
                    os.close(fd)
            except (OSError, ValueError) as exc:  # unreadable, or a malformed ELF file
                probed[m.file] = f"not readable: {exc}"
        out.append((m.path, probed[m.file]))
    return out


def cuda_report(pid: int) -> str:
    """Per process of `pid`'s tree: the CUDA libraries it maps and the probed symbols each
    exports, or that it maps none.  Raises TargetError when `pid` does not run."""
    from trainbpf.tracer.collectors.cuda import CALLS
    from trainbpf.tracer.proctree import is_alive, process_tree

    if pid <= 0 or not is_alive(pid):
        raise TargetError(f"no such process: {pid} (--pid takes a process id, the kernel's tgid)")
    tree = process_tree(pid)
    more = len(tree) - 1
    lines = [f"CUDA libraries of process {pid}" + (f" and its {more} descendant{'s' * (more > 1)}" if more else "")
             + " (what `record --pid` would probe now; it rescans while recording):"]
    probed: dict = {}
    for p in tree:
        found = process_cuda(p, probed)
        head = f"  pid {p} ({_comm(p)})"
        if isinstance(found, str) or not found:
            lines.append(f"{head}: {found or 'no CUDA library mapped'}")
            continue
        lines.append(head)
        for path, exported in found:
            if isinstance(exported, str):
                lines.append(f"    {path}: {exported}")
                continue
            symbols, calls = [sym for sym, _ in exported], {call for _, call in exported}
            lines.append(f"    {path}: {len(symbols)} probed symbols ({len(calls)} of the {len(CALLS)} calls)"
                         + (":" if symbols else ", nothing to probe"))
            lines += textwrap.wrap(", ".join(symbols), 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)
