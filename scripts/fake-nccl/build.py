#!/usr/bin/env python3
"""Build the stand-in NCCL: `build.py DIR` compiles libnccl.c into a tree laid out like
pip's nvidia-nccl wheel, DIR/site-packages/nvidia/nccl/lib/libnccl.so.2, and prints its
path."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from standin_build import compile_library, main  # noqa: E402

LIBRARY = Path("site-packages/nvidia/nccl/lib/libnccl.so.2")
# -fno-ipa-icf: calls with the same body (ncclAllReduce, ncclBroadcast, ...) must stay
# distinct functions (addresses); frame pointers and no shrink-wrapping: every function
# starts with push %rbp, as scripts/fake-cuda/build.py says.
CFLAGS = ("-fno-ipa-icf", "-fno-omit-frame-pointer", "-fno-shrink-wrap", "-pthread")


def build(out_dir: Path) -> Path:
    """Compile the library under `out_dir` and return its path."""
    return compile_library(Path(out_dir) / LIBRARY, [HERE / "libnccl.c"], *CFLAGS, what="NCCL")


if __name__ == "__main__":
    main(build, "scripts/fake-nccl/build.py")
