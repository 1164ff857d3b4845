"""What recording needs from the machine, checked once for both `trainbpf doctor` (which
reports every check) and `trainbpf record` (which stops at the first that fails).

Each check gives a status (ok / warn / fail), what it found, and a fix hint."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainbpf.trace.errors import EnvironmentCheckError, NotRootError, TrainbpfError

OK, WARN, FAIL = "ok", "warn", "fail"
CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39
KALLSYMS = Path("/proc/kallsyms")
DOCTOR = "run `trainbpf doctor`"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges() -> Check:
    if os.geteuid() == 0:
        return Check("privileges", OK, "running as root")
    caps = effective_caps()
    if caps & (1 << CAP_SYS_ADMIN) or (caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)):
        return Check("privileges", OK, "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN)")
    return Check("privileges", FAIL, "not root and no CAP_BPF/CAP_PERFMON",
                 "run with sudo (see README: sudo keeps PATH out, so give the venv's full path)")


def check_tracefs() -> Check:
    from trainbpf.tracer.loader import ensure_tracefs

    try:
        root = ensure_tracefs(mount=True)
    except TrainbpfError:
        return Check("tracefs", FAIL, "not mounted and could not mount it",
                     "sudo mount -t tracefs nodev /sys/kernel/tracing")
    return Check("tracefs", OK, f"mounted at {root}")


def check_headers() -> Check:
    from trainbpf.tracer.kheaders import find_headers

    try:
        headers = find_headers(create=os.geteuid() == 0)
    except TrainbpfError as exc:
        return Check("kernel headers", FAIL, str(exc), "run scripts/setup.sh as root")
    if headers is None:
        return Check("kernel headers", FAIL, "none found for bcc",
                     "apt-get install linux-headers-$(uname -r) or linux-headers-amd64")
    if headers.exact:
        return Check("kernel headers", OK, f"{headers.origin}: {headers.path}")
    return Check("kernel headers", OK,
                 f"{headers.origin} at {headers.path} (not the running kernel's; the probes read "
                 "only tracepoint fields, so any recent headers serve)")


def check_bcc() -> Check:
    try:
        import bcc
    except ImportError as exc:
        return Check("bcc", FAIL, f"not importable: {exc}",
                     "apt-get install python3-bpfcc; use a venv created with --system-site-packages "
                     "from /usr/bin/python3 (scripts/setup.sh does this)")
    version = getattr(getattr(bcc, "version", None), "__version__", "?")
    return Check("bcc", OK, f"bcc {version} from {Path(bcc.__file__).parent}")


def check_kernel_symbols(path: Path = KALLSYMS) -> Check:
    """Kernel stacks are named from /proc/kallsyms, which shows every address as 0 to a
    process without CAP_SYSLOG (or to all, with kernel.kptr_restrict=2): bcc then reads
    the whole file again for each address it cannot place, and a recording spends its
    time, and a health check all of its time limit, naming frames."""
    if os.geteuid() != 0 and not effective_caps() & (1 << CAP_BPF | 1 << CAP_SYS_ADMIN):
        return Check("kernel symbols", WARN, "not checked without privileges", "run doctor with sudo")
    with path.open() as lines:
        # the first code symbol: per-CPU data ("A"), listed first on some kernels, is at 0
        first = next((fields for fields in map(str.split, lines) if fields[1:2] in (["T"], ["t"])), None)
    if first is None or int(first[0], 16) != 0:
        return Check("kernel symbols", OK, f"{path} shows addresses")
    if _sysctl("kernel/kptr_restrict") == "2":
        return Check("kernel symbols", FAIL, f"{path} shows every address as 0 (kernel.kptr_restrict=2)",
                     "sysctl kernel.kptr_restrict=1")
    return Check("kernel symbols", FAIL, f"{path} shows every address as 0 (no CAP_SYSLOG)",
                 "run as root with CAP_SYSLOG (a container: add the SYSLOG capability)")


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return None


# What record checks before it compiles anything: privileges first (before the target and
# the output are looked at), then the rest.
ENVIRONMENT: tuple[Callable[[], Check], ...] = (check_tracefs, check_headers, check_bcc, check_kernel_symbols)


def require(*checks: Callable[[], Check]) -> None:
    """Raise on the first of `checks` that fails: what doctor reports as failed, record
    refuses, with one line pointing at doctor."""
    for check in checks:
        c = check()
        if c.status != FAIL:
            continue
        if check is check_privileges:
            raise NotRootError(f"recording needs root, or CAP_BPF and CAP_PERFMON: {c.fix}")
        raise EnvironmentCheckError(f"{c.name}: {c.detail}; {DOCTOR}")
