"""The floors of the code (README.md, "Layout"; docs/design.md, "Architecture"): a lower
floor never imports a higher one, and every name has one address.

    trainbpf/  (cli, doctor, reports, health, fleet)      the roof
    tracer/    analyzers/                                 the recorder; the analysis
    trace/     (the trace contract)                       the ground floor

tracer/ and analyzers/ share a floor and never import each other: a trace file is all
that passes between recording and analysis.  Inside tracer/, the collectors, symbolisers
and samplers never import the session that runs them (tracer/record.py and its loop).

Inside analyzers/, the stages are ordered too (STAGES): a stage imports only earlier ones.

Imports inside functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"trace": "trainbpf.trace", "tracer": "trainbpf.tracer", "analyzers": "trainbpf.analyzers",
           "probes": "trainbpf.probes", "trainbpf": "trainbpf"}
FLOOR = {"trainbpf.trace": 0, "trainbpf.probes": 0, "trainbpf.tracer": 1, "trainbpf.analyzers": 1, "trainbpf": 2}
# the recorder's session: what runs the sources, which the sources never import
SESSION = ("trainbpf.tracer.record", "trainbpf.tracer.drain", "trainbpf.tracer.record_output")
# analyzers/ in pipeline order: the shared base, then each stage; a module's stage is its
# longest matching prefix
STAGES = ("trainbpf.analyzers.vocab trainbpf.analyzers.options trainbpf.analyzers.intervals",
          "trainbpf.analyzers.threads", "trainbpf.analyzers.causes", "trainbpf.analyzers.timeline",
          "trainbpf.analyzers.findings", "trainbpf.analyzers.trainer", "trainbpf.analyzers.job",
          "trainbpf.analyzers.pipeline", "trainbpf.analyzers.job_traces")
RENDERERS = ("trainbpf.reports.text", "trainbpf.reports.html", "trainbpf.reports.html_timeline",
             "trainbpf.reports.html_job", "trainbpf.reports.render")
SOURCE_FOLDERS = ("trainbpf.tracer.collectors", "trainbpf.tracer.symbols", "trainbpf.tracer.samplers")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts[1:] if p != "__init__"]
    return ".".join([FOLDERS[rel.parts[0]], *parts])


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}


def floor_package(module: str) -> str:
    for package in ("trainbpf.trace", "trainbpf.probes", "trainbpf.tracer", "trainbpf.analyzers"):
        if module == package or module.startswith(package + "."):
            return package
    return "trainbpf"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "trainbpf" or n.startswith("trainbpf.")]
    return out


def imports_of(modules: dict[str, Path], root: Path) -> Iterator[tuple[str, str, str]]:
    """(importer, target, "path:line imports target") for every import of ours."""
    for name, path in sorted(modules.items()):
        for line, target in imported_modules(path):
            yield name, target, f"{path.relative_to(root)}:{line} imports {target}"


def layer_violations(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    bad = []
    for name, target, where in imports_of(modules, root):
        home, there = floor_package(name), floor_package(target)
        if FLOOR[there] > FLOOR[home]:
            bad.append(f"{where} (a higher floor)")
        elif FLOOR[there] == FLOOR[home] and there != home:
            bad.append(f"{where} (a sibling floor: only a trace file passes between them)")
        elif name.startswith(SOURCE_FOLDERS) and target.startswith(SESSION):
            bad.append(f"{where} (a source imports the session that runs it)")
    return bad


def stage_of(module: str) -> int | None:
    for i, names in enumerate(STAGES):
        if any(module == n or module.startswith(n + ".") for n in names.split()):
            return i
    return None


def stage_violations(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    return [f"{where} (a later stage)" for name, target, where in imports_of(modules, root)
            if stage_of(name) is not None and stage_of(target) is not None and stage_of(target) > stage_of(name)]


def test_the_report_document_imports_no_renderer():
    """reports/document.py holds numbers, JSON and sentences; the renderers import it,
    never the reverse."""
    imported = {target for _, target in imported_modules(ROOT / "trainbpf" / "reports" / "document.py")}
    assert not imported & set(RENDERERS), imported & set(RENDERERS)


def test_every_analyzers_module_has_a_stage():
    modules = [m for m in project_modules() if m.startswith("trainbpf.analyzers.")]
    assert [m for m in modules if stage_of(m) is None] == []


def test_no_stage_imports_a_later_one(tmp_path):
    assert stage_violations(project_modules()) == []
    planted = tmp_path / "trainbpf.analyzers.causes.planted.py"
    planted.write_text("from trainbpf.analyzers.findings.ranking import build_findings\n")
    assert stage_violations({"trainbpf.analyzers.causes.planted": planted}, tmp_path) == [
        "trainbpf.analyzers.causes.planted.py:1 imports trainbpf.analyzers.findings.ranking (a later stage)"]


def test_no_floor_imports_a_higher_one():
    modules = project_modules()
    assert len(modules) > 60, sorted(modules)
    assert layer_violations(modules) == []


def test_the_check_sees_a_lower_floor_importing_a_higher_one(tmp_path):
    """The check itself can fail: a module of trace/ importing the roof, one of tracer/
    importing analyzers/ (lazily, inside a function), a collector importing the
    recorder's session; the roof importing the ground floor is fine."""
    planted = {
        "trainbpf.trace.planted": "from trainbpf.reports.text import render_text\n",
        "trainbpf.tracer.planted": "def f():\n    from trainbpf.analyzers.pipeline import analyze\n",
        "trainbpf.tracer.collectors.planted": "import trainbpf.tracer.record\n",
        "trainbpf.reports.planted": "from trainbpf.trace.schema import COLUMNS\n",
    }
    modules = {}
    for name, text in planted.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    found = "\n".join(layer_violations(modules, tmp_path))
    assert "trainbpf.trace.planted.py:1 imports trainbpf.reports.text (a higher floor)" in found
    assert "trainbpf.tracer.planted.py:2 imports trainbpf.analyzers.pipeline (a sibling floor" in found
    assert "imports trainbpf.tracer.record (a source imports the session" in found
    assert "trainbpf.reports.planted" not in found


@pytest.mark.parametrize("face", ["analyzers/__init__.py", "trainbpf/health/__init__.py", "trace/__init__.py"])
def test_package_faces_re_export_nothing(face):
    """One address per name: a package's __init__ holds its docstring, no re-exports."""
    tree = ast.parse((ROOT / face).read_text())
    assert [type(n).__name__ for n in tree.body[1:]] == []


def own_names(tree: ast.Module) -> set[str]:
    """The names a module defines itself, or takes from outside the project."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("trainbpf"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def second_addresses(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """`from M import n` where M only imported n from another module of ours."""
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    owned = {name: own_names(tree) for name, tree in trees.items()}
    bad = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in owned):
                continue
            for alias in node.names:
                if alias.name not in owned[node.module] and f"{node.module}.{alias.name}" not in modules:
                    bad.append(f"{modules[name].relative_to(root)}:{node.lineno} takes {alias.name} from {node.module}")
    return bad


def test_every_name_has_one_address():
    modules = project_modules()
    tests = {f"tests.{p.stem}": p for p in (ROOT / "tests").glob("*.py")}
    assert second_addresses({**modules, **tests}) == []


def test_the_check_sees_a_second_address(tmp_path):
    planted = {"trainbpf.trace.home": "def make_batch():\n    pass\n",
               "trainbpf.trace.face": "from trainbpf.trace.home import make_batch\n",
               "trainbpf.tracer.user": "from trainbpf.trace.face import make_batch\n"}
    modules = {}
    for name, text in planted.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    assert second_addresses(modules, tmp_path) == [
        "trainbpf.tracer.user.py:1 takes make_batch from trainbpf.trace.face"]


def test_pyproject_installs_every_folder_and_nothing_else():
    """A folder missing from pyproject's packages is left out of a wheel (an editable
    install would not show it); a listed one that is not a folder stops the install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {module_name(init) for top in FOLDERS for init in (ROOT / top).rglob("__init__.py")}
    assert listed == folders
