#!/usr/bin/env python3
"""Build the stand-in NVML library: `build.py DIR` compiles libnvidia-ml.c into
DIR/libnvidia-ml.so.1, the name pynvml loads; point LD_LIBRARY_PATH at DIR."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("libnvidia-ml.c")
SONAME = "libnvidia-ml.so.1"


class BuildError(RuntimeError):
    pass


def build(out_dir: Path) -> Path:
    """Compile the stand-in into `out_dir` (created) and return the library's path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc not found: the stand-in NVML library needs it (scripts/setup.sh --test installs it)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / SONAME
    done = subprocess.run(
        [gcc, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-Wl,-soname,{SONAME}",
         "-o", str(lib), str(SOURCE), "-lm"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise BuildError(f"gcc failed on {SOURCE.name}: {done.stderr.strip()}")
    return lib


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/fake-nvml/build.py DIR")
    try:
        print(build(Path(sys.argv[1])))
    except BuildError as exc:
        sys.exit(str(exc))
