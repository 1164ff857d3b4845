"""Which kernel headers bcc compiles the probes against.

bcc wants headers for the running kernel.  Where none are installed (common on cloud and
VM kernels) any recent Debian/Ubuntu headers serve, because the probes read only
tracepoint fields and stable helpers.  Debian splits a header package into an arch folder
and a `-common` folder; bcc's BCC_KERNEL_SOURCE takes one folder, so we build a private
merged tree of symlinks in a cache folder instead of writing into system folders.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainbpf.trace.errors import EnvironmentCheckError

SRC_ROOT = Path("/usr/src")
MODULES_ROOT = Path("/lib/modules")
CACHE_ROOT = Path(os.environ.get("TRAINBPF_CACHE", "/var/cache/trainbpf"))


@dataclass(frozen=True)
class KernelHeaders:
    path: Path  # what BCC_KERNEL_SOURCE points at (or the running kernel's build dir)
    origin: str  # "running kernel", "BCC_KERNEL_SOURCE", "merged <pkg>"
    exact: bool  # headers of the running kernel itself


def _running_build_dir() -> Path | None:
    build = MODULES_ROOT / platform.release() / "build"
    return build if (build / "include").is_dir() else None


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))


def _debian_pairs() -> list[tuple[Path, Path]]:
    """(arch dir, common dir) pairs of installed Debian header packages, newest first."""
    pairs = []
    for common in SRC_ROOT.glob("linux-headers-*-common"):
        prefix = common.name[: -len("-common")]
        for arch in SRC_ROOT.glob(prefix + "-*"):
            if arch != common and (arch / "include" / "generated").is_dir():
                pairs.append((arch, common))
    return sorted(pairs, key=lambda p: _version_key(p[0].name), reverse=True)


def _merge(arch: Path, common: Path, dest: Path) -> None:
    """A tree of symlinks: common files overlaid by the arch package's generated ones."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for src in (common, arch):
        for root, dirs, files in os.walk(src):
            rel = Path(root).relative_to(src)
            (tmp / rel).mkdir(parents=True, exist_ok=True)
            for f in files:
                link = tmp / rel / f
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(Path(root) / f)
    (tmp / ".complete").touch()
    try:
        os.rename(tmp, dest)
    except OSError:  # another process won the race; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)


def find_headers(*, create: bool = True) -> KernelHeaders | None:
    """The headers bcc will use, building the merged tree if needed (and allowed)."""
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env and (Path(env) / "include").is_dir():
        return KernelHeaders(Path(env), "BCC_KERNEL_SOURCE", False)
    build = _running_build_dir()
    if build:
        return KernelHeaders(build, "running kernel", True)
    pairs = _debian_pairs()
    if not pairs:
        return None
    arch, common = pairs[0]
    dest = CACHE_ROOT / f"kernel-headers-{arch.name}"
    if not (dest / ".complete").exists():
        if not create:
            return KernelHeaders(dest, f"merged {arch.name} (not built yet)", False)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _merge(arch, common, dest)
        except OSError as exc:
            raise EnvironmentCheckError(
                f"cannot build the merged kernel header tree in {dest.parent}: {exc.strerror}; "
                "run `trainbpf doctor`"
            ) from exc
    return KernelHeaders(dest, f"merged {arch.name}", False)


def use_headers() -> KernelHeaders:
    """Point bcc at usable headers (sets BCC_KERNEL_SOURCE) or raise."""
    headers = find_headers()
    if headers is None:
        raise EnvironmentCheckError(
            "no kernel headers found for bcc (install linux-headers-amd64 or the running "
            "kernel's headers); run `trainbpf doctor`"
        )
    if not headers.exact:
        os.environ["BCC_KERNEL_SOURCE"] = str(headers.path)
    else:
        # An empty or stale BCC_KERNEL_SOURCE would send bcc past the running kernel's
        # headers to its fallback, which runs `sh -c "modprobe kheaders"` and prints
        # "Unable to find kernel headers" on stdout (docs/security.md).
        os.environ.pop("BCC_KERNEL_SOURCE", None)
    return headers
