"""The benchmarks' helper modules (scripts/bench/), loaded as the benchmark scripts
import them, without putting scripts/bench on every test's import path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


def bench_module(name: str) -> ModuleType:
    """scripts/bench/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module
