"""Compiling and loading the probes with bcc.

bcc rewrites map calls (`map.lookup()`) and generates tracepoint argument structs only in
the main source text, not in included files, so the loader concatenates probes/common.h
and each selected probe's .bpf.c into one text (with #line markers so compiler messages
name the right file) instead of #include-ing them."""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import functools
import importlib.resources
import os
import subprocess
from pathlib import Path

from trainbpf.trace.errors import EnvironmentCheckError
from trainbpf.trace.schema import PY_STACK_ID_BASE
from trainbpf.tracer.collector import (
    PROBE_IDS,
    Collector,
    ctypes_to_dtype,
    delete_keys,
    probe_defines,
)
from trainbpf.tracer.collectors.block import BlockCollector
from trainbpf.tracer.collectors.cuda import CudaCollector
from trainbpf.tracer.collectors.disk import DiskCollector
from trainbpf.tracer.collectors.faults import FaultsCollector
from trainbpf.tracer.collectors.futex import FutexCollector
from trainbpf.tracer.collectors.mm import MmCollector
from trainbpf.tracer.collectors.nccl import NcclCollector
from trainbpf.tracer.collectors.net import NetCollector
from trainbpf.tracer.collectors.oncpu import OnCpuCollector
from trainbpf.tracer.collectors.pagecache import PageCacheCollector
from trainbpf.tracer.collectors.sched import SchedCollector
from trainbpf.tracer.collectors.tlb import TlbCollector
from trainbpf.tracer.collectors.writeback import WritebackCollector
from trainbpf.tracer.collectors.writepath import WritePathCollector
from trainbpf.tracer.kheaders import use_headers
from trainbpf.tracer.settings import Settings
from trainbpf.tracer.symbols import pystacks

ALL_COLLECTORS: tuple[type[Collector], ...] = (
    SchedCollector, FutexCollector, FaultsCollector, OnCpuCollector, MmCollector,
    WritebackCollector, BlockCollector, DiskCollector, CudaCollector, NcclCollector, WritePathCollector,
    PageCacheCollector, NetCollector, TlbCollector,
)
PROBE_NAMES = tuple(c.name for c in ALL_COLLECTORS)
TRACEFS = Path(os.environ.get("TRAINBPF_TRACEFS", "/sys/kernel/tracing"))  # where tracefs lives or is mounted
DOCTOR = "run `trainbpf doctor`"
BTF_VMLINUX = Path("/sys/kernel/btf/vmlinux")
KALLSYMS = Path("/proc/kallsyms")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MAX_RECORD_BYTES = 176  # the largest event struct plus the ring buffer's 8-byte header, rounded up
MAX_DETACH_THREADS = 64  # closes waited on side by side at the stop
# Threads one recording traces at once: every per-thread map (the traced set, the probes'
# entries in flight) holds this many, preallocated.
MAX_THREADS = 65536


def probes_dir() -> Path:
    return Path(str(importlib.resources.files("trainbpf.probes")))


def ensure_tracefs(*, mount: bool = True) -> Path:
    """tracefs's root, mounting it when missing (bcc reads tracepoint layouts there)."""
    if (TRACEFS / "events").is_dir():
        return TRACEFS
    legacy = Path("/sys/kernel/debug/tracing")
    if "TRAINBPF_TRACEFS" not in os.environ and (legacy / "events").is_dir():
        return legacy
    if mount and os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)],
                       stdin=subprocess.DEVNULL, capture_output=True, check=False)
        if (TRACEFS / "events").is_dir():
            return TRACEFS
    raise EnvironmentCheckError(f"tracefs is not mounted at {TRACEFS}; {DOCTOR}")


def tracepoint_exists(tp: str, root: Path = TRACEFS) -> bool:
    category, _, event = tp.partition(":")
    return (root / "events" / category / event / "format").exists()


def field_offsets(tp: str, fields: tuple[str, ...], root: Path = TRACEFS) -> dict[str, int]:
    """-D <EVENT>_<FIELD>_AT = each field's offset in the tracepoint's record, as its
    tracefs format file lays it out (a line "field:char name[32];\toffset:8;\tsize:32;...")."""
    category, _, event = tp.partition(":")
    at: dict[str, int] = {}
    try:
        text = (root / "events" / category / event / "format").read_text()
    except OSError as exc:
        raise EnvironmentCheckError(f"kernel lacks tracepoint {tp}: {exc.strerror}; {DOCTOR}") from exc
    for line in text.splitlines():
        parts = dict(p.strip().split(":", 1) for p in line.split(";") if ":" in p)
        if "field" in parts and "offset" in parts:
            at[parts["field"].split()[-1].split("[")[0]] = int(parts["offset"])
    missing = [f for f in fields if f not in at]
    if missing:
        raise EnvironmentCheckError(f"tracepoint {tp} lacks field(s) {', '.join(missing)}; {DOCTOR}")
    return {f"{event.upper()}_{f.upper()}_AT": at[f] for f in fields}


def have_define(tp: str) -> str:
    """-D name announcing an optional tracepoint (see #ifdef HAVE_TP_... in the probes)."""
    return "HAVE_TP_" + tp.replace(":", "_").upper()


@functools.lru_cache(maxsize=None)
def raw_tracepoint_exists(name: str) -> bool:
    """Whether a bare tracepoint (one without a tracefs entry) can be attached: the
    kernel's BTF has a `btf_trace_<name>` type for every tracepoint, kallsyms a
    `__traceiter_<name>`."""
    try:
        return b"\0btf_trace_" + name.encode() + b"\0" in BTF_VMLINUX.read_bytes()
    except OSError:
        pass
    try:
        return f" __traceiter_{name}\n" in KALLSYMS.read_text()
    except OSError:
        return False


def have_raw_define(name: str) -> str:
    """-D name announcing an optional raw tracepoint (#ifdef HAVE_RAW_TP_... in the probes)."""
    return "HAVE_RAW_TP_" + name.upper()


def select(names: list[str] | None, settings: Settings) -> list[Collector]:
    """The collectors of the probes `names`; none given: the default set, every probe
    but the opt-in ones (Collector.opt_in), for which "default" also stands."""
    if not names:
        return [c(settings) for c in ALL_COLLECTORS if not c.opt_in]
    unknown = sorted(set(names) - set(PROBE_NAMES) - {"default"})
    if unknown:
        from trainbpf.trace.errors import UsageError

        raise UsageError(f"unknown probe(s) {', '.join(unknown)}; choose from default, {', '.join(PROBE_NAMES)}")
    if "default" in names:
        names = [*names, *(c.name for c in ALL_COLLECTORS if not c.opt_in)]
    chosen = [c(settings) for c in ALL_COLLECTORS if c.name in names]
    if not any(c.name == "sched" for c in chosen):  # the thread table and off-CPU states
        chosen.insert(0, SchedCollector(settings))
    return chosen


def import_bcc():
    try:
        import bcc  # noqa: F401  (Debian's python3-bpfcc)
    except ImportError as exc:
        raise EnvironmentCheckError(
            f"bcc is not importable ({exc}); install python3-bpfcc and use a venv made with "
            f"--system-site-packages; {DOCTOR}"
        ) from exc
    return bcc


def build_source(collectors: list[Collector]) -> str:
    pdir = probes_dir()
    parts = [f'#line 1 "common.h"\n', (pdir / "common.h").read_text(),
             f'\n#line 1 "pyframes.h"\n', (pdir / "pyframes.h").read_text()]
    for c in collectors:
        if c.source is None:
            continue
        parts.append(f'\n#line 1 "{c.source}"\n')
        parts.append((pdir / c.source).read_text())
    return "".join(parts)


@functools.lru_cache(maxsize=None)
def py_stack_table() -> tuple[int, int]:
    """(PY_CPUS, PY_STACK_ENTRIES) of the kernel's Python stack table (probes/pyframes.h):
    the CPU ids the kernel may run a program on, each owning 1/PY_CPUS of the slots, so
    more CPUs get more slots, within the native stack map's ~17 MB."""
    try:
        text = Path("/sys/devices/system/cpu/possible").read_text().strip()
        cpus = 1 + max(int(part.split("-")[-1]) for part in text.split(","))
    except (OSError, ValueError):
        cpus = os.cpu_count() or 1
    return cpus, min(max(16384, 1024 * cpus), 65536)


def cflags(collectors: list[Collector], settings: Settings, tracefs: Path) -> list[str]:
    py_cpus, py_stack_entries = py_stack_table()
    defines: dict[str, int | str] = {
        **probe_defines(),
        **settings.defines(),
        "MAX_THREADS": MAX_THREADS,
        "SELF_TGID": os.getpid(),
        **pystacks.probe_defines(),
        "PY_CPUS": py_cpus,
        "PY_STACK_ENTRIES": py_stack_entries,
        "PY_STACK_ID_BASE": PY_STACK_ID_BASE,
        # Forced ring-buffer wake-ups (common.h submit_flags) often enough that all CPUs
        # together fill at most a quarter of a ring between two.
        "WAKEUP_EVERY": max(1, settings.ringbuf_pages * PAGE_SIZE // (4 * MAX_RECORD_BYTES * (os.cpu_count() or 1))),
    }
    for c in collectors:
        defines.update(c.defines())
        for tp, fields in c.fields_at.items():
            defines.update(field_offsets(tp, fields, tracefs))
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    for c in collectors:
        flags += [f"-D{have_define(tp)}" for tp in c.optional_tracepoints if tracepoint_exists(tp, tracefs)]
        flags += [f"-D{have_raw_define(tp)}" for tp in c.optional_raw_tracepoints if raw_tracepoint_exists(tp)]
    return flags + ["-I" + str(probes_dir()), "-w"]


def check_tracepoints(collectors: list[Collector], tracefs: Path) -> None:
    missing = [tp for c in collectors for tp in c.tracepoints if not tracepoint_exists(tp, tracefs)]
    if missing:
        raise EnvironmentCheckError(f"kernel lacks tracepoint(s) {', '.join(missing)}; {DOCTOR}")


def load(collectors: list[Collector], settings: Settings):
    """Compile and load the probes; tracepoint programs attach as they load."""
    tracefs = ensure_tracefs()
    check_tracepoints(collectors, tracefs)
    use_headers()
    bcc = import_bcc()
    try:
        bpf = bcc.BPF(text=build_source(collectors), cflags=cflags(collectors, settings, tracefs))
        for c in collectors:
            c.attach(bpf)
    except Exception as exc:  # bcc raises bare Exception for compile and load failures
        raise EnvironmentCheckError(f"loading the probes failed: {str(exc).splitlines()[0]}; {DOCTOR}") from exc
    return bpf


def detach(bpf) -> None:
    """Detach every program and perf event (bpf.cleanup), tracepoints and uprobes concurrently:
    closing a tracepoint's perf event waits for an RCU grace period in the kernel, and
    side by side the waits overlap (docs/performance.md, "Costs the code is shaped by").
    ctypes drops the GIL around each close."""
    # Uprobes the same: each close waits for the kernel to unregister the probe (~0.1 s
    # here), and a recording with the CUDA, NCCL or allocator probes holds tens of them.
    detaching = [(bpf.detach_tracepoint, tp) for tp in bpf.tracepoint_fds] + \
                [(bpf.detach_uprobe_event, ev) for ev in bpf.uprobe_fds]
    if detaching:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(detaching), MAX_DETACH_THREADS)) as pool:
            for done in [pool.submit(fn, name) for fn, name in detaching]:
                done.exception()  # whatever failed, cleanup() below retries and raises
    # A perf event whose descriptor is already gone is already detached (the kernel let go
    # of it with its last reference); bcc would retry the close, fail on EBADF and leave
    # every later program attached.  Descriptors went missing while bcc named process
    # addresses (it closed numbers it never opened: tracer/symbols/anon.py), which the
    # recorder no longer asks it to; this stays for whatever else may close one.
    for fds in (bpf.tracepoint_fds, bpf.uprobe_fds):
        for name, fd in list(fds.items()):
            if not _is_open(fd):
                del fds[name]
    # The same for a program's descriptor (its attachment holds the program).
    for name, fn in list(bpf.funcs.items()):
        if not _is_open(fn.fd):
            del bpf.funcs[name]
    bpf.cleanup()


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def event_dtypes(bpf, collectors: list[Collector]) -> dict[str, "object"]:
    """numpy dtype of each ring buffer's records, from the C struct bcc parsed."""
    from bcc.table import _get_event_class

    return {rb: ctypes_to_dtype(_get_event_class(bpf[rb])) for c in collectors for rb in c.ringbufs}


def set_traced(bpf, tid: int, tgid: int) -> None:
    bpf["traced"][ctypes.c_uint32(tid)] = ctypes.c_uint32(tgid)


def untrace(bpf, tids: list[int]) -> None:
    """Threads out of the traced set (they exited)."""
    delete_keys(bpf["traced"], tids)


def stack_counts(bpf) -> dict[str, int]:
    """Stack walks, and those lost because their hash bucket held another stack."""
    table = bpf["stack_counts"]
    return {"walks": int(sum(table[ctypes.c_int(0)])), "collisions": int(sum(table[ctypes.c_int(1)]))}


def missed_runs(bpf) -> dict[str, int]:
    """Runs of each program the kernel skipped (its `recursion_misses`, from the program's
    fdinfo), by attach point: a tracepoint program does not run while another BPF program
    runs on the same CPU, so a wake-up from an interrupt that arrives inside one (a
    timer's, an on-CPU sample's) goes unseen.  Only programs that missed any."""
    missed = {}
    for name, fn in bpf.funcs.items():
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            text = Path(f"/proc/self/fdinfo/{fn.fd}").read_text()
        except OSError:
            continue
        count = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("recursion_misses:")), 0)
        if count:
            if name.startswith("tracepoint__"):  # bcc's name for TRACEPOINT_PROBE(category, event)
                name = name.removeprefix("tracepoint__").replace("__", ":", 1)
            missed[name] = count
    return missed


def lost_counts(bpf) -> dict[str, int]:
    table = bpf["lost"]
    return {name: int(sum(table[ctypes.c_int(i)])) for name, i in PROBE_IDS.items()}
