"""`trainbpf fleet`: health documents of many nodes merged into one ranked table."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainbpf.errors import UsageError
from trainbpf.fleet import run_fleet

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
                                 {"targets": [{"starved_ratio": 0.5, "findings": [{"share": "most"}]}]}])
def test_one_bad_document_is_skipped_and_the_rest_ranked(folder, bad):
    """issue 15 M2: a malformed document costs its own row, not the table."""
    (folder / "bad.json").write_text(json.dumps({**document("node-x", "critical", 0.9, "other", share=0.5), **bad}))
    text, skipped = run_fleet(source=str(folder), fmt="json")
    assert [n["host"] for n in json.loads(text)["nodes"]] == ["node-b", "node-a", "node-f", "node-e", "node-d", "node-c"]
    assert any("bad.json" in s and "malformed" in s for s in skipped), skipped
