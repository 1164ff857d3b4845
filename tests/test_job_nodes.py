"""A job of two nodes, faked on this machine: two torchrun launchers in two network
namespaces (tests/netns_env.py) forming one world of 4 ranks of
scripts/workloads/ddp_job.py over gloo, rank 2 (node 1's first) late in every step
decoding its own batches.  Each node is recorded by a recorder of its own through its
launcher's pid; the two traces analysed together must name rank 2 the straggler, and
still do with node 1's wall-clock offset 50 ms off in its metadata."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from job_harness import record_two_nodes
from kernel_env import require_module, require_root
from scenario_harness import trainbpf_cli

from trainbpf.trace.meta import meta_bytes
from trainbpf.trace.rowgroups import write_parquet
from trainbpf.trace.schema import METADATA_KEY

SLOW_RANK = 2
SHIFT_MS = 50


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> list[Path]:
    require_root("records two torchrun launchers in network namespaces of their own")
    require_module("torch", "a torchrun job")
    return record_two_nodes(tmp_path_factory.mktemp("two-nodes"), slow_rank=SLOW_RANK)


def analyze(*paths: Path) -> dict:
    run = subprocess.run([str(trainbpf_cli()), "analyze", *map(str, paths), "--format", "json"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def shifted_copy(trace: Path, out: Path, shift_ns: int) -> Path:
    """A copy of `trace` whose metadata's wall-clock offset is `shift_ns` off."""
    source = pq.ParquetFile(trace)
    meta = json.loads(source.schema_arrow.metadata[METADATA_KEY])
    meta["clock"]["wall_minus_mono_ns"] += shift_ns
    with open(out, "wb") as fh:
        write_parquet(fh, source.iter_batches(), meta_bytes(meta))
    return out


def test_two_nodes_recorded_apart_name_the_late_rank(traces):
    doc = analyze(*traces)
    assert [t["ranks"] for t in doc["traces"]] == [[0, 1], [2, 3]], doc["traces"]
    assert [r["world_size"] for r in doc["ranks"]] == [4] * 4 and [r["local_rank"] for r in doc["ranks"]] == [0, 1, 0, 1]
    assert doc["straggler"] and doc["straggler"]["rank"] == SLOW_RANK, doc["ranks"]
    assert doc["straggler"]["category"] == "input_pipeline", doc["straggler"]
    # One machine, one clock: what the collectives add to the wall clocks is noise.
    assert doc["traces"][1]["aligned_by"] == "collectives" and abs(doc["traces"][1]["residual_offset_ms"]) < 2, doc["traces"]
    assert doc["findings"][0]["category"] == "input_pipeline" and doc["findings"][0]["evidence"]["held_ranks"] == [0, 1, 3]


def test_a_node_clock_50_ms_off_leaves_the_straggler_as_it_was(traces, tmp_path):
    shifted = shifted_copy(traces[1], tmp_path / "node1-shifted.parquet", SHIFT_MS * 1_000_000)
    doc = analyze(traces[0], shifted)
    assert abs(doc["traces"][1]["residual_offset_ms"] + SHIFT_MS) < 2, doc["traces"]
    assert doc["straggler"] and doc["straggler"]["rank"] == SLOW_RANK, doc["ranks"]
    assert doc["straggler"]["category"] == "input_pipeline", doc["straggler"]
