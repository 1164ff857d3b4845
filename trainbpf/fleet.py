"""`trainbpf fleet`: many nodes' health JSON documents merged into one table that ranks
the nodes by starved share, with each node's top stall category, where the CUDA calls
were traced its training step time and host-bound share, and where a node's check saw a
job of several ranks, the rank the others waited for (the straggler)."""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import math
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainbpf.health.outputs import HEALTH_SCHEMA
from trainbpf.trace.documents import load_json
from trainbpf.trace.errors import UsageError
from trainbpf.trace.printable import printable
from trainbpf.trace.safefile import OutputFile, check_output, read_small, write_new

FLEET_SCHEMA = "trainbpf.fleet/1"
FORMATS = ("text", "json", "csv")
# Worst first: a critical node, then one that could not be checked, then a warning.
STATUS_ORDER = {"critical": 0, "unknown": 1, "warning": 2, "ok": 3}


@dataclass(frozen=True)
class FleetRow:
    rank: int
    host: str
    status: str
    exit_code: int
    starved_ratio: float | None
    top_category: str | None
    top_share: float | None
    targets: int
    cuda_traced: bool | None  # the worst target's CUDA calls; None: no target analysed
    step_p50_s: float | None
    step_p99_s: float | None
    steps_per_s: float | None
    host_bound_share: float | None
    finished: str
    error: str | None
    file: str
    straggler_rank: int | None = None  # the node's job's straggler; -1: a job without one; None: no job


def _straggler_rank(doc: dict[str, Any]) -> int | None:
    job = doc.get("job")
    if not job:
        return None
    return -1 if job.get("straggler") is None else int(job["straggler"]["rank"])


# The walk that finds the documents: symlinked folders are not entered (a link back up
# would loop), and it goes no deeper, and looks at no more entries, than any fleet's
# layout needs.
MAX_WALK_DEPTH = 32
MAX_WALK_ENTRIES = 1_000_000
_MAGIC = re.compile(r"[*?[]")


def health_files(source: str) -> list[Path]:
    """A folder (every *.json below it) or a glob pattern (`**`: any folders below)."""
    path = Path(source)
    if path.is_dir():
        return _walk(source, lambda names: fnmatch.fnmatchcase(names[-1], "*.json"), MAX_WALK_DEPTH)
    if not _MAGIC.search(source):
        return [path] if path.is_file() else []
    parts = source.split("/")
    first = next(i for i, part in enumerate(parts) if _MAGIC.search(part))
    base, pattern = "/".join(parts[:first]) or ("/" if source.startswith("/") else ""), parts[first:]
    depth = MAX_WALK_DEPTH if "**" in pattern else len(pattern) - 1
    return _walk(base, lambda names: _glob_match(names, pattern), depth)


def _walk(base: str, wanted, max_depth: int) -> list[Path]:
    """Regular files below folder `base` (the current one when "") whose names from
    there `wanted(names)` takes, at most `max_depth` folders down."""
    found, seen = [], 0
    for folder, dirs, files in os.walk(base or ".", followlinks=False):
        rel = [] if folder == (base or ".") else os.path.relpath(folder, base or ".").split(os.sep)
        seen += len(dirs) + len(files)
        if seen > MAX_WALK_ENTRIES:
            raise UsageError(f"{base or '.'}: more than {MAX_WALK_ENTRIES} entries below it; "
                             "give the folder that holds the health documents")
        if len(rel) >= max_depth:
            dirs.clear()
        found += [Path(folder, f) if base else Path(*rel, f) for f in files
                  if wanted(rel + [f]) and os.path.isfile(os.path.join(folder, f))]
    return sorted(found)


def _glob_match(names: list[str], pattern: list[str]) -> bool:
    """Whether a path's `names` match a glob's `pattern` parts, as glob.glob(recursive=True)
    matches: `**` any number of folders, a leading dot only by a part that has one."""
    def part_matches(name: str, part: str) -> bool:
        return (part.startswith(".") or not name.startswith(".")) and fnmatch.fnmatchcase(name, part)

    # reach[i]: the first i names are matched by the parts taken so far
    reach = [True] + [False] * len(names)
    for part in pattern:
        if part == "**":
            new, on = [False] * len(reach), False
            for i, ok in enumerate(reach):
                on = ok or (on and not names[i - 1].startswith("."))
                new[i] = on
        else:
            new = [False] + [reach[i] and part_matches(names[i], part) for i in range(len(names))]
        reach = new
    return reach[-1]


def load_documents(files: list[Path]) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """(file, document) of every health document, newest per host, and one line per file
    skipped."""
    newest: dict[str, tuple[Path, dict[str, Any]]] = {}
    skipped = []
    for path in files:
        try:  # read as the user who named it: a small regular file, never waited on
            doc = load_json(read_small(path, str(path)))
        except UsageError as exc:  # not a regular file, too large, not readable
            skipped.append(str(exc))
            continue
        except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, TooDeep
            skipped.append(f"{path}: not readable JSON ({exc})")
            continue
        if not isinstance(doc, dict) or doc.get("schema") != HEALTH_SCHEMA:
            skipped.append(f"{path}: not a {HEALTH_SCHEMA} document")
            continue
        problem = document_problem(doc)
        if problem:
            skipped.append(f"{path}: malformed {HEALTH_SCHEMA} document ({problem})")
            continue
        host = str(doc.get("host"))
        if host not in newest or doc.get("finished_timestamp", 0) > newest[host][1].get("finished_timestamp", 0):
            newest[host] = (path, doc)
    return list(newest.values()), skipped


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def document_problem(doc: dict[str, Any]) -> str | None:
    """What makes a health document unusable for the table (None: nothing)."""
    for key in ("host", "status", "top_category", "finished", "error"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            return f"{key} is not a string"
    for key in ("starved_ratio", "finished_timestamp"):
        if doc.get(key) is not None and not _number(doc[key]):
            return f"{key} is not a number"
    if not isinstance(doc.get("exit_code", 3), int) or isinstance(doc.get("exit_code"), bool):
        return "exit_code is not an integer"
    targets = doc.get("targets", [])
    if not isinstance(targets, list) or not all(isinstance(t, dict) for t in targets):
        return "targets is not a list of objects"
    for steps in [doc.get("steps")] + [t.get("steps") for t in targets]:
        if steps is not None and not isinstance(steps, dict):
            return "steps is not an object"
        for key, value in (steps or {}).items():
            if value is not None and not (isinstance(value, bool) if key == "traced" else _number(value)):
                return f"steps.{key} is not a {'boolean' if key == 'traced' else 'number'}"
    job = doc.get("job")
    if job is not None and not (isinstance(job, dict) and (job.get("straggler") is None or (
            isinstance(job["straggler"], dict) and isinstance(job["straggler"].get("rank"), int)
            and not isinstance(job["straggler"]["rank"], bool)))):
        return "job is not an object with a straggler that has an integer rank"
    for t in targets:
        if t.get("starved_ratio") is not None and not _number(t["starved_ratio"]):
            return "a target's starved_ratio is not a number"
        findings = t.get("findings") or []
        if not isinstance(findings, list) or not all(isinstance(f, dict) and _number(f.get("share")) for f in findings):
            return "a target's findings are not a list of objects with a share"
    return None


def _top_share(doc: dict[str, Any]) -> float | None:
    """The share of the top category in the worst target's findings."""
    graded = [t for t in doc.get("targets", []) if t.get("starved_ratio") is not None]
    if not graded:
        return None
    worst = max(graded, key=lambda t: t["starved_ratio"])
    return worst["findings"][0]["share"] if worst.get("findings") else None


def fleet_rows(documents: list[tuple[Path, dict[str, Any]]]) -> list[FleetRow]:
    """One row per node, most starved first; nodes without a starved share (no target,
    or not checked) follow, worst status first."""
    def order(item: tuple[Path, dict[str, Any]]) -> tuple:
        doc = item[1]
        starved = doc.get("starved_ratio")
        return (starved is None, -(starved or 0.0), STATUS_ORDER.get(str(doc.get("status")), len(STATUS_ORDER)), str(doc.get("host")))

    rows = []
    for rank, (path, doc) in enumerate(sorted(documents, key=order), start=1):
        steps = doc.get("steps") or {}
        rows.append(FleetRow(
            rank=rank, host=str(doc.get("host")), status=str(doc.get("status")), exit_code=int(doc.get("exit_code", 3)),
            starved_ratio=doc.get("starved_ratio"), top_category=doc.get("top_category"), top_share=_top_share(doc),
            targets=len(doc.get("targets", [])), cuda_traced=steps.get("traced"), step_p50_s=steps.get("step_p50_s"),
            step_p99_s=steps.get("step_p99_s"), steps_per_s=steps.get("steps_per_s"),
            host_bound_share=steps.get("host_bound_share"), finished=str(doc.get("finished", "")), error=doc.get("error"), file=str(path),
            straggler_rank=_straggler_rank(doc),
        ))
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _step_cell(r: FleetRow) -> str:
    if r.cuda_traced is None:
        return "-"
    if not r.cuda_traced:
        return "not traced"
    if r.step_p50_s is None or r.step_p99_s is None:
        return "no step"
    return f"{r.step_p50_s * 1e3:.3g}/{r.step_p99_s * 1e3:.3g} ms"


def category_counts(rows: list[FleetRow]) -> dict[str, int]:
    return dict(Counter(r.top_category for r in rows if r.top_category).most_common())


def render(rows: list[FleetRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"schema": FLEET_SCHEMA, "nodes": [asdict(r) for r in rows],
                           "top_categories": category_counts(rows)}, indent=2) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        names = list(FleetRow.__dataclass_fields__)
        writer.writerow(names)
        for r in rows:
            writer.writerow(["" if v is None else printable(v) if isinstance(v, str) else v
                             for v in (getattr(r, n) for n in names)])
        return buf.getvalue()
    jobs = any(r.straggler_rank is not None for r in rows)  # the straggler column only where a job was seen
    table = [("rank", "host", "status", "starved", "top category", "share", "step p50/p99", "steps/s", "host-bound",
              "targets", *(("straggler",) if jobs else ()), "checked (UTC)")]
    for r in rows:
        straggler = ("-" if r.straggler_rank is None else "none" if r.straggler_rank < 0 else f"rank {r.straggler_rank}",)
        table.append(tuple(map(printable, (
            r.rank, r.host, r.status, _pct(r.starved_ratio), r.top_category or "-", _pct(r.top_share), _step_cell(r),
            "-" if r.steps_per_s is None else f"{r.steps_per_s:.3g}", _pct(r.host_bound_share), r.targets,
            *(straggler if jobs else ()), r.finished.replace("T", " ").rstrip("Z")))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    counts = category_counts(rows)
    if counts:
        lines.append("")
        lines.append("top categories: " + ", ".join(f"{printable(c)} {n} node{'s' if n != 1 else ''}"
                                                    for c, n in counts.items()))
    stragglers = [f"rank {r.straggler_rank} on {printable(r.host)}" for r in rows if (r.straggler_rank or -1) >= 0]
    if stragglers:
        lines.append("stragglers (the rank its job's other ranks waited for): " + ", ".join(stragglers))
    return "\n".join(lines) + "\n"


def run_fleet(*, source: str, fmt: str = "text", output: Path | None = None,
              force: bool = False) -> tuple[str, list[str]]:
    """The fleet table of the health documents at `source` (a folder or a glob) as
    `fmt`, written to `output` when given (an existing file only with `force`); returns
    (text, lines about skipped files)."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: choose {', '.join(FORMATS)}")
    # Checked before the documents are read; written into the folder checked then.
    out = check_output(output, force=force) if output is not None else None
    try:
        return _fleet_text(source, fmt, out)
    finally:
        if out is not None:
            out.close()


def _fleet_text(source: str, fmt: str, out: OutputFile | None) -> tuple[str, list[str]]:
    files = health_files(source)
    if not files:
        raise UsageError(f"{source}: no health JSON files (a folder of them or a glob such as '/shared/health/*.json')")
    documents, skipped = load_documents(files)
    if not documents:
        raise UsageError(f"{source}: none of the {len(files)} JSON files is a {HEALTH_SCHEMA} document")
    text = render(fleet_rows(documents), fmt)
    if out is not None:
        write_new(out, lambda fh: fh.write(text.encode()))
    return text, skipped
