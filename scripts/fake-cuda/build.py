#!/usr/bin/env python3
"""Build the stand-in CUDA runtime and driver: `build.py DIR` compiles libcuda.c and
libcudart.c into a tree laid out like pip's nvidia wheels,
DIR/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12 (which finds the driver by its
rpath) and DIR/site-packages/nvidia/cuda_driver/lib/libcuda.so.1, and prints the
runtime's path."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from standin_build import compile_library, main  # noqa: E402

RUNTIME = Path("site-packages/nvidia/cuda_runtime/lib/libcudart.so.12")
DRIVER = Path("site-packages/nvidia/cuda_driver/lib/libcuda.so.1")
# -fno-ipa-icf: aliases with the same body must stay distinct functions (addresses);
# frame pointers: every function starts with push %rbp, as most library code does,
# which the kernel emulates under a uprobe (a `sub $n,%rsp` first would be
# single-stepped, several times slower), and user stacks walk.
CFLAGS = ("-fno-ipa-icf", "-fno-omit-frame-pointer")


def build(out_dir: Path) -> Path:
    """Compile both libraries under `out_dir` and return the runtime's path."""
    out_dir = Path(out_dir)
    driver, runtime = out_dir / DRIVER, out_dir / RUNTIME
    compile_library(driver, [HERE / "libcuda.c"], *CFLAGS, what="CUDA driver")
    return compile_library(runtime, [HERE / "libcudart.c"], *CFLAGS, f"-L{driver.parent}", "-l:libcuda.so.1",
                           "-Wl,-rpath,$ORIGIN/../../cuda_driver/lib", what="CUDA runtime")


if __name__ == "__main__":
    main(build, "scripts/fake-cuda/build.py")
