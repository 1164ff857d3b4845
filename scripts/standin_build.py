"""Compile a stand-in C library (scripts/fake-nvml, scripts/fake-cuda) with gcc: shared,
position-independent, warnings as errors, its soname its file name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable


class BuildError(RuntimeError):
    pass


def compile_library(out: Path, sources: list[Path], *extra: str, what: str) -> Path:
    """Build `out` from `sources` (gcc flags in `extra`); `what` names the library in errors."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError(f"gcc not found: the stand-in {what} needs it (scripts/setup.sh --test installs it)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [gcc, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-Wl,-soname,{out.name}",
         "-o", str(out), *map(str, sources), *extra],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise BuildError(f"gcc failed on {', '.join(Path(s).name for s in sources)}: {done.stderr.strip()}")
    return out


def main(build: Callable[[Path], Path], script: str) -> None:
    """A build script's command line: `script DIR` prints what `build(DIR)` made."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: {script} DIR")
    try:
        print(build(Path(sys.argv[1])))
    except BuildError as exc:
        sys.exit(str(exc))
