#!/usr/bin/env python3
"""Build the stand-in NVML library: `build.py DIR` compiles libnvidia-ml.c into
DIR/libnvidia-ml.so.1, the name pynvml loads; point LD_LIBRARY_PATH at DIR."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from standin_build import compile_library, main  # noqa: E402

SONAME = "libnvidia-ml.so.1"


def build(out_dir: Path) -> Path:
    """Compile the stand-in into `out_dir` (created) and return the library's path."""
    return compile_library(Path(out_dir) / SONAME, [HERE / "libnvidia-ml.c"], "-lm", what="NVML library")


if __name__ == "__main__":
    main(build, "scripts/fake-nvml/build.py")
