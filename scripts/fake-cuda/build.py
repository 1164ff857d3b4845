#!/usr/bin/env python3
"""Build the stand-in CUDA runtime and driver: `build.py DIR` compiles libcuda.c and
libcudart.c into a tree laid out like pip's nvidia wheels,
DIR/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12 (which finds the driver by its
rpath) and DIR/site-packages/nvidia/cuda_driver/lib/libcuda.so.1, and prints the
runtime's path."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNTIME = Path("site-packages/nvidia/cuda_runtime/lib/libcudart.so.12")
DRIVER = Path("site-packages/nvidia/cuda_driver/lib/libcuda.so.1")


class BuildError(RuntimeError):
    pass


def _gcc(gcc: str, out: Path, source: Path, *extra: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # -fno-ipa-icf: aliases with the same body must stay distinct functions (addresses);
    # frame pointers: every function starts with push %rbp, as most library code does,
    # which the kernel emulates under a uprobe (a `sub $n,%rsp` first would be
    # single-stepped, several times slower), and user stacks walk.
    done = subprocess.run(
        [gcc, "-O2", "-fno-ipa-icf", "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
         f"-Wl,-soname,{out.name}", "-o", str(out), str(source), *extra],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise BuildError(f"gcc failed on {source.name}: {done.stderr.strip()}")


def build(out_dir: Path) -> Path:
    """Compile both libraries under `out_dir` and return the runtime's path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc not found: the stand-in CUDA libraries need it (scripts/setup.sh --test installs it)")
    out_dir = Path(out_dir)
    driver, runtime = out_dir / DRIVER, out_dir / RUNTIME
    _gcc(gcc, driver, HERE / "libcuda.c")
    _gcc(gcc, runtime, HERE / "libcudart.c", f"-L{driver.parent}", "-l:libcuda.so.1",
         "-Wl,-rpath,$ORIGIN/../../cuda_driver/lib")
    return runtime


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/fake-cuda/build.py DIR")
    try:
        print(build(Path(sys.argv[1])))
    except BuildError as exc:
        sys.exit(str(exc))
