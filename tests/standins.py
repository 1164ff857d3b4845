"""The stand-in libraries under scripts/ (fake-cuda, fake-nccl, ...), built for a test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def build_standin(name: str, out_dir: Path) -> Path:
    """Run scripts/NAME/build.py's build() into `out_dir`: the library's path."""
    spec = importlib.util.spec_from_file_location(f"{name.replace('-', '_')}_build", SCRIPTS / name / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build(out_dir)
