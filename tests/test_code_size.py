"""Rooms a reader can hold in mind (README.md, "Layout"; docs/design.md, "Architecture"):
no source, test or script file over 450 lines, no Python function over 80. Split by
meaning when one grows."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
CODE_FOLDERS = ("trainbpf/", "trace/", "tracer/", "analyzers/", "probes/", "tests/", "scripts/", "deploy/", ".ci/")
NOT_CODE = (".md", ".json", ".toml", ".parquet", ".txt")


def code_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / f for f in listed if f.startswith(CODE_FOLDERS) and not f.endswith(NOT_CODE)
             and not f.startswith("tests/data/")]
    return [f for f in files if f.is_file()]


def python_text(path: Path) -> str | None:
    text = path.read_text(errors="replace")
    if path.suffix == ".py" or (path.suffix == "" and text.startswith("#!") and "python" in text.split("\n", 1)[0]):
        return text
    return None


def long_functions(text: str, name: str) -> list[str]:
    return [f"{name}:{n.lineno} {n.name} {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_file_over_450_lines():
    files = code_files()
    assert len(files) > 100
    big = [f"{f.relative_to(ROOT)} {n} lines" for f in files
           if (n := len(f.read_text(errors="replace").splitlines())) > MAX_FILE_LINES]
    assert big == []


def test_no_function_over_80_lines():
    found = []
    for f in code_files():
        text = python_text(f)
        if text is not None:
            found += long_functions(text, str(f.relative_to(ROOT)))
    assert found == []


def test_the_function_check_counts_decorators_docstrings_and_bodies():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert long_functions(f"def short():\n{body[:-len(body.splitlines()[-1]) - 1]}\n", "m") == []
    assert long_functions(f"def long():\n{body}\n", "m") == ["m:1 long 81 lines"]
