"""`trainbpf fleet`: health documents of many nodes merged into one ranked table."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainbpf.fleet import run_fleet
from trainbpf.trace.errors import UsageError

TRAINBPF = [sys.executable, "-m", "trainbpf.cli"]


def document(host: str, status: str, starved: float | None, category: str | None, *, share: float | None = None,
             finished: float = 1_800_000_000.0) -> dict:
    code = {"ok": 0, "warning": 1, "critical": 2, "unknown": 3}[status]
    targets = []
    if starved is not None:
        findings = [{"category": category, "share": share, "seconds": 1.0, "severity": "critical", "summary": "s"}] if share else []
        targets = [{"pid": 10, "starved_ratio": starved / 2, "findings": []},
                   {"pid": 11, "starved_ratio": starved, "findings": findings}]
    return {"schema": "trainbpf.health/1", "host": host, "status": status, "exit_code": code, "error": None,
            "finished": "2027-01-15T08:00:00Z", "finished_timestamp": finished, "mode": "targets" if targets else "node",
            "starved_ratio": starved, "top_category": category, "targets": targets}


@pytest.fixture
def folder(tmp_path):
    docs = [
        document("node-a", "warning", 0.3, "cpu_contention", share=0.55),
        document("node-b", "critical", 0.8, "input_pipeline", share=0.7),
        document("node-c", "ok", None, None),
        document("node-d", "unknown", None, None),
        document("node-e", "critical", None, "memory_reclaim"),  # node-level only
        document("node-f", "ok", 0.05, "input_pipeline", share=0.9),
    ]
    for doc in docs:
        sub = tmp_path / doc["host"][-1]
        sub.mkdir()
        (sub / "health.json").write_text(json.dumps(doc))
    # an older document of node-b, which the newer one replaces
    (tmp_path / "b" / "old.json").write_text(json.dumps(document("node-b", "ok", 0.01, "other", share=1.0, finished=1.0)))
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    (tmp_path / "broken.json").write_text("{")
    return tmp_path


def test_nodes_rank_by_starved_share_then_status(folder):
    text, skipped = run_fleet(source=str(folder), fmt="json")
    doc = json.loads(text)
    assert doc["schema"] == "trainbpf.fleet/1"
    nodes = doc["nodes"]
    assert [n["host"] for n in nodes] == ["node-b", "node-a", "node-f", "node-e", "node-d", "node-c"]
    assert [n["rank"] for n in nodes] == [1, 2, 3, 4, 5, 6]
    assert (nodes[0]["starved_ratio"], nodes[0]["top_category"], nodes[0]["top_share"]) == (0.8, "input_pipeline", 0.7)
    assert nodes[0]["file"].endswith("b/health.json")
    assert doc["top_categories"] == {"input_pipeline": 2, "cpu_contention": 1, "memory_reclaim": 1}
    assert len(skipped) == 2 and any("broken.json" in s for s in skipped) and any("notes.json" in s for s in skipped)


def test_text_and_csv(folder):
    text, _ = run_fleet(source=str(folder), fmt="text")
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["rank", "host", "status", "starved"]
    assert lines[1].split()[:6] == ["1", "node-b", "critical", "80.0%", "input_pipeline", "70.0%"]
    assert lines[-1] == "top categories: input_pipeline 2 nodes, cpu_contention 1 node, memory_reclaim 1 node"
    rows = list(csv.DictReader(io.StringIO(run_fleet(source=f"{folder}/*/health.json", fmt="csv")[0])))
    assert [r["host"] for r in rows] == ["node-b", "node-a", "node-f", "node-e", "node-d", "node-c"]
    assert rows[0]["starved_ratio"] == "0.8" and rows[3]["starved_ratio"] == ""


def test_the_straggler_of_each_nodes_job(folder):
    """A node whose check saw a job names the rank its other ranks waited for (-1: none);
    the text table shows the column only where some node saw a job."""
    assert "straggler" not in run_fleet(source=str(folder), fmt="text")[0]
    for sub, straggler in (("a", {"rank": 3, "pid": 4242, "last_arrival_share": 0.9, "others_waited_s": 2.0,
                                  "category": "input_pipeline"}), ("f", None)):
        doc = json.loads((folder / sub / "health.json").read_text())
        (folder / sub / "health.json").write_text(json.dumps({**doc, "job": {"ranks": [], "straggler": straggler}}))
    nodes = {n["host"]: n for n in json.loads(run_fleet(source=str(folder), fmt="json")[0])["nodes"]}
    assert (nodes["node-a"]["straggler_rank"], nodes["node-f"]["straggler_rank"], nodes["node-b"]["straggler_rank"]) \
        == (3, -1, None)
    lines = run_fleet(source=str(folder), fmt="text")[0].splitlines()
    column = lines[0].index("straggler")
    cells = {line.split()[1]: line[column:].split()[0:2] for line in lines[1:7]}
    assert (cells["node-a"], cells["node-f"][0], cells["node-b"][0]) == (["rank", "3"], "none", "-")
    assert lines[-1] == "stragglers (the rank its job's other ranks waited for): rank 3 on node-a"
    rows = {r["host"]: r for r in csv.DictReader(io.StringIO(run_fleet(source=str(folder), fmt="csv")[0]))}
    assert (rows["node-a"]["straggler_rank"], rows["node-f"]["straggler_rank"], rows["node-b"]["straggler_rank"]) \
        == ("3", "-1", "")


def test_bad_input(tmp_path):
    with pytest.raises(UsageError, match="no health JSON files"):
        run_fleet(source=str(tmp_path / "nothing-*.json"))
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(UsageError, match="none of the 1 JSON files"):
        run_fleet(source=str(tmp_path))
    with pytest.raises(UsageError, match="--format yaml"):
        run_fleet(source=str(tmp_path), fmt="yaml")


def test_cli(folder, tmp_path):
    out = tmp_path / "fleet.csv"
    proc = subprocess.run([*TRAINBPF, "fleet", str(folder), "--format", "csv", "--output", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("rank,host,status")
    assert proc.stderr.count("trainbpf: warning: skipped") == 2
    proc = subprocess.run([*TRAINBPF, "fleet", str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("trainbpf: error:") and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", [{"starved_ratio": "x"}, {"targets": "notalist"}, {"targets": [1]},
                                 {"exit_code": "2"}, {"finished_timestamp": "yesterday"},
                                 {"targets": [{"starved_ratio": "x"}]},
                                 {"targets": [{"starved_ratio": 0.5, "findings": [{"share": "most"}]}]},
                                 {"top_category": ["x"]}, {"host": {"name": "x"}}, {"error": 3},
                                 {"job": "x"}, {"job": {"straggler": 1}}, {"job": {"straggler": {"rank": "1"}}}])
def test_one_bad_document_is_skipped_and_the_rest_ranked(folder, bad):
    """issue 15 M2: a malformed document costs its own row, not the table."""
    (folder / "bad.json").write_text(json.dumps({**document("node-x", "critical", 0.9, "other", share=0.5), **bad}))
    text, skipped = run_fleet(source=str(folder), fmt="json")
    assert [n["host"] for n in json.loads(text)["nodes"]] == ["node-b", "node-a", "node-f", "node-e", "node-d", "node-c"]
    assert any("bad.json" in s and "malformed" in s for s in skipped), skipped


def test_a_deeply_nested_document_is_skipped(folder):
    """issue 34 item 6: JSON nested deeper than Python's parser recurses is one skipped
    file, not a RecursionError."""
    (folder / "deep.json").write_text('{"schema": "trainbpf.health/1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (folder / "deep100.json").write_text(json.dumps({**document("node-y", "ok", 0.1, "other"), "x": 0}
                                                    ).replace('"x": 0', '"x": ' + "[" * 100 + "]" * 100))
    text, skipped = run_fleet(source=str(folder), fmt="json")
    assert len(json.loads(text)["nodes"]) == 6
    assert any("deep.json" in s and "nested deeper than 64 levels" in s for s in skipped), skipped
    assert any("deep100.json" in s and "nested deeper than 64 levels" in s for s in skipped), skipped


def test_a_glob_does_not_follow_symlinked_folders(folder):
    """issue 34 item 6: links back up the tree (two of them: every path through them is
    another match for glob's `**`) are not entered; each document is read once."""
    (folder / "a" / "up").symlink_to("..")
    (folder / "b" / "top").symlink_to(folder)
    (folder / "elsewhere").symlink_to(folder / "a", target_is_directory=True)
    proc = subprocess.run([*TRAINBPF, "fleet", f"{folder}/**/*.json", "--format", "json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    files = sorted(Path(n["file"]).relative_to(folder).as_posix() for n in json.loads(proc.stdout)["nodes"])
    assert files == ["a/health.json", "b/health.json", "c/health.json", "d/health.json", "e/health.json",
                     "f/health.json"]
    assert proc.stderr.count("trainbpf: warning: skipped") == 2  # notes.json, broken.json


def test_output_is_replaced_only_with_force(folder, tmp_path):
    """issue 34 item 10: `fleet -o` writes as `analyze -o` does (trainbpf.trace.safefile)."""
    out = tmp_path / "fleet.txt"
    out.write_text("keep me\n")
    proc = subprocess.run([*TRAINBPF, "fleet", str(folder), "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 13, proc.stderr
    assert f"{out} exists; give --force to replace it" in proc.stderr and out.read_text() == "keep me\n"
    proc = subprocess.run([*TRAINBPF, "fleet", str(folder), "-o", str(out), "--force"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("rank  host")
    assert oct(out.stat().st_mode & 0o777) == "0o600"


def test_control_characters_in_host_names_are_escaped(folder):
    """issue 34 item 10: a host name cannot drive the terminal reading the table."""
    evil = "node-\x1b]0;owned\x07\x1b[2J\u202egood"
    (folder / "evil.json").write_text(json.dumps({**document(evil, "critical", 0.95, "x\x1b[31m", share=0.5)}))
    for fmt in ("text", "csv"):
        proc = subprocess.run([*TRAINBPF, "fleet", str(folder), "--format", fmt], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\u202e" not in proc.stdout
        assert "node-\\x1b]0;owned\\x07\\x1b[2J\\u202egood" in proc.stdout, proc.stdout
