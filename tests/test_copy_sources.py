"""NUMA from where the bytes are (issue 31, item 2): host->device copies through the
stand-in CUDA runtime (tests/numa_workloads.py) recorded with the stand-in NVML saying
the GPU's node, under a declared two-node topology (this machine has one node: every
page is on node 0).  The recorder looks up each copy's source page with a query-only
move_pages(2); a BPF program on syscalls:sys_enter_move_pages watches that it never
passes a `nodes` array (which would move pages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel_env import require_root
from scenario_harness import fake_nvml_env, trainbpf_cli
from standins import build_standin
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report
from trainbpf.reports.render import run_analyze
from trainbpf.trace.reader import read_trace
from trainbpf.trace.spool import spool_path_for

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = {"nodes": {"0": [0], "1": [1]}}  # GPUs not declared: their node comes from the device

# Every move_pages call on the machine: (tgid, nr_pages, nodes, flags), most recent last.
WATCH_MOVE_PAGES = r"""
struct call { u32 tgid; u32 pad; u64 nr_pages; u64 nodes; u64 flags; };
BPF_ARRAY(calls, struct call, 4096);
BPF_ARRAY(count, u64, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_move_pages) {
    int zero = 0;
    u64 *n = count.lookup(&zero);
    if (!n)
        return 0;
    u64 i = __sync_fetch_and_add(n, 1);
    int slot = i & 4095;
    struct call *c = calls.lookup(&slot);
    if (!c)
        return 0;
    c->tgid = bpf_get_current_pid_tgid() >> 32;
    c->nr_pages = args->nr_pages;
    c->nodes = (u64)args->nodes;
    c->flags = args->flags;
    return 0;
}
"""


def _record(tmp: Path, gpu_node: int) -> tuple:
    """The workload recorded with the stand-in NVML putting the GPU on `gpu_node`: the
    trace, the workload's report, and the recorder's pid."""
    runtime = build_standin("fake-cuda", tmp / "wheel")
    env = {**fake_nvml_env(tmp), "FAKE_NVML_NUMA_NODE": str(gpu_node)}
    (tmp / "topology.json").write_text(json.dumps(TOPOLOGY))
    trace, out = tmp / "trace.parquet", tmp / "workload.json"
    workload = subprocess.Popen([sys.executable, str(ROOT / "tests" / "numa_workloads.py"), "--runtime", str(runtime),
                                 "--hold-until", str(spool_path_for(trace)), "--seconds", "3", "--out", str(out)],
                                env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert workload.stdout.readline().strip() == f"ready pid={workload.pid}"
        recorder = subprocess.Popen([str(trainbpf_cli()), "record", "--pid", str(workload.pid), "--duration", "60",
                                     "--gpu", "nvml", "--probes", "sched,oncpu,cuda", "--topology",
                                     str(tmp / "topology.json"), "-o", str(trace)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, stderr = recorder.communicate(timeout=180)
        assert recorder.returncode == 0, stderr
        assert workload.wait(timeout=30) == 0
    finally:
        if workload.poll() is None:
            workload.kill()
            workload.wait()
    return read_trace(trace), json.loads(out.read_text()), recorder.pid


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """The GPU on node 1, the copies' pages on node 0, move_pages watched throughout."""
    require_root()
    from bcc import BPF

    from trainbpf.tracer import kheaders

    kheaders.use_headers()
    watch = BPF(text=WATCH_MOVE_PAGES)
    try:
        trace, truth, recorder_pid = _record(tmp_path_factory.mktemp("numa_remote"), 1)
        n = watch["count"][0].value
        calls = [(c.tgid, c.nr_pages, c.nodes, c.flags) for c in list(watch["calls"].values())[:min(n, 4096)]]
    finally:
        watch.cleanup()
    analysis = analyze(trace)
    return trace, truth, recorder_pid, calls, analysis, Report.of(analysis).doc


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The same copies with the GPU on node 0, the pages' own node."""
    require_root()
    trace, truth, _ = _record(tmp_path_factory.mktemp("numa_local"), 0)
    analysis = analyze(trace)
    return trace, truth, analysis, Report.of(analysis).doc


def test_gpu_node_from_nvml_in_the_metadata(remote, local):
    for trace, node in ((remote[0], 1), (local[0], 0)):
        topo = trace.meta["topology"]
        assert topo["gpu_node"] == node and topo["gpus"][0]["node"] == node, topo
        assert topo["nodes"] == TOPOLOGY["nodes"] and topo["declared"] is True


def test_each_copy_source_page_node_recorded(remote):
    trace, truth = remote[0], remote[1]
    rows = trace.view("copy_node")
    host = rows[rows["source"] == "host"]
    # every host->device copy of the loader, from its node-0 buffer
    assert len(host) == truth["to_device"], (len(host), truth)
    assert (host["src"].astype("int64") == truth["host_ptr"]).all()
    assert (host["node"] == 0).all() and (host["tid"] == truth["loader"]).all()
    assert (host["bytes"] == 1 << 20).all() and set(host["policy"]) == {"default"}
    # copies from the device pointer answered -EFAULT/-ENOENT: not host memory
    device = rows[rows["source"] == "not_host"]
    assert len(device) == truth["from_device"] and (device["src"].astype("int64") == truth["device_ptr"]).all()
    calls = trace.view("cuda_call")
    copies = calls[(calls["state"] == "copy") & (calls["nested"] == 0)]
    assert set(copies["src"].astype("int64")) == {truth["host_ptr"], truth["device_ptr"]}


def test_move_pages_only_queried_and_rate_limited(remote):
    trace, recorder_pid, calls = remote[0], remote[2], remote[3]
    mine = [c for c in calls if c[0] == recorder_pid]
    assert mine, f"the recorder made no move_pages call ({len(calls)} on the machine)"
    assert all(nodes == 0 and flags == 0 for _, _, nodes, flags in mine), mine
    # each distinct page at most once a second: two pages over ~3.5 s, not one per copy
    assert len(mine) == trace.meta["copy_sources"]["page_queries"] <= 10, len(mine)


def test_thread_affinity_recorded(remote):
    trace, truth = remote[0], remote[1]
    aff = trace.view("affinity")
    loader = aff[aff["tid"] == truth["loader"]]
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert len(loader) == 1 and loader["mems"].iloc[0] == "0", aff
    assert loader["cpus"].iloc[0] in (cpus, f"0-{os.cpu_count() - 1}")


def test_remote_copies_named_by_the_finding(remote):
    truth, analysis, doc = remote[1], remote[4], remote[5]
    numa = doc["numa"]
    assert numa["gpu_node"] == 1 and numa["remote_share"] == pytest.approx(1.0)
    assert numa["copied_bytes"] == truth["to_device"] << 20 and numa["bytes_by_node"] == {"0": numa["copied_bytes"]}
    assert numa["threads"][0]["tid"] == truth["loader"] and not numa["threads"][0]["restricted"]
    finding = next(f for f in doc["findings"] if f["category"] == "numa_remote")
    assert finding["summary"].startswith("100% of the ") and "copied to GPU 0 (node 1) came from node 0 pages" \
        in finding["summary"], finding["summary"]
    assert f"tb_loader ({truth['loader']})" in finding["summary"] and "no affinity" in finding["summary"]
    assert "allocate the pinned buffers there" in finding["recommendation"]
    assert "--cpunodebind=1" in finding["recommendation"]


def test_text_and_html_show_the_copied_bytes(remote):
    trace = remote[0]
    text = run_analyze(path=trace.path, fmt="text")
    assert "Copied to the GPU from host memory:" in text and "100% from other nodes" in text
    html = run_analyze(path=trace.path, fmt="html")
    assert "Copied to the GPU from host memory:" in html


def test_gpu_on_the_pages_node_has_no_remote_share(local):
    truth, doc = local[1], local[3]
    numa = doc["numa"]
    assert numa["gpu_node"] == 0 and numa["remote_share"] == pytest.approx(0.0)
    assert numa["copied_bytes"] == truth["to_device"] << 20
    summaries = [f["summary"] for f in doc["findings"] if f["category"] == "numa_remote"]
    assert not any("copied to GPU" in s for s in summaries), summaries


def test_health_series_of_the_remote_share(remote, local):
    from trainbpf.health.config import DEFAULT_THRESHOLDS, OK
    from trainbpf.health.outputs import render_textfile
    from trainbpf.health.results import HealthResult, grade_report
    from trainbpf.health.targets import Target
    from test_health_outputs import parse_exposition

    for doc, share in ((remote[5], 1.0), (local[3], 0.0)):
        target = Target(4242, "python", "python train.py", "pid")
        result = grade_report(target, doc, tids=set(), thresholds=DEFAULT_THRESHOLDS)
        assert result.remote_copy_share == pytest.approx(share)
        now = time.time()
        values = parse_exposition(render_textfile(HealthResult(OK, "h", now, now, "targets", [result])))
        assert values[("trainbpf_target_numa_remote_copy_ratio", (("pid", "4242"),))] == pytest.approx(share)
