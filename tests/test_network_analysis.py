"""Network waits (issue 30): a loader waiting on a socket is a network_io finding that
names the peer (its seconds, bytes, requests, latency, retransmits), and the upload that
shared the interface during the waits; a poll wait counts only where the thread received
on a socket then.  Synthetic traces with a known answer, made to the trace contract of
the network kinds (docs/trace-format.md)."""

from __future__ import annotations

import json
import time

import pytest

from synth import POLL_STACK, RECV_STACK, START_NS as START, TRAINER, Synth, periodic
from trainbpf.analyzers.pipeline import analyze
from trainbpf.reports.document import Report, build_report, render_json
from trainbpf.reports.html import render_html
from trainbpf.reports.text import render_text

LOADER = 200
UPLOADER = 300
STORE = 5001  # the loader's socket to the store
CKPT = 6001  # the uploader's socket
PEER = "10.0.0.2:8080"
MiB = 1 << 20


def _slow_store(s: Synth, *, kstack=RECV_STACK, traffic: bool = True, period: float = 0.2,
                family: str = "ipv4") -> None:
    """The trainer runs 130 ms then waits 70 ms on a futex for the loader, which waits
    95 ms for each 1 MiB batch from the store (one request, answered after 95 ms), runs
    5 ms and hands it over."""
    s.thread(TRAINER, "python")
    s.thread(LOADER, "loader")
    s.socket(LOADER, STORE, PEER if family != "unix" else "/run/store.sock", family=family,
             protocol=6 if family != "unix" else 0)
    for x in periodic(0.0, s.duration_s, period):
        s.offcpu(TRAINER, x + 0.13, 0.07, waker=LOADER, kstack=("schedule", "futex_wait_queue", "futex_wait"))
        s.futex(TRAINER, x + 0.13, 0.069, addr=0x7F00_0000_1000)
        s.offcpu(LOADER, x + 0.1, 0.095, kstack=kstack)
        if traffic:
            s.net_io(LOADER, x + 0.1, STORE, 64, direction="send")
            s.net_io(LOADER, x + 0.1, STORE, MiB)
            s.net_request(LOADER, x + 0.1, STORE, requests=1, latency=0.095, max_latency=0.095)


def _trace(tmp_path, extra=None, *, name="trace.parquet", **kwargs):
    s = Synth()
    _slow_store(s, **kwargs)
    if extra:
        extra(s)
    s.gpu_from_running(TRAINER)
    return analyze(s.read(tmp_path, name))


def _top(a) -> dict:
    return build_report(a)["findings"][0]


def test_a_loader_waiting_on_the_store_is_network_io_naming_the_peer(tmp_path):
    f = _top(_trace(tmp_path))
    assert f["category"] == "network_io"
    assert f["share"] > 0.8
    assert [c["state"] for c in f["chain"]] == ["futex", "network_io"]
    peer = next(c for c in f["culprits"] if c["kind"] == "peer")
    assert peer["name"] == PEER
    assert peer["seconds"] == pytest.approx(f["seconds"], rel=0.05)
    assert peer["recv_bytes"] == 50 * MiB and peer["send_bytes"] == 50 * 64
    assert peer["requests"] == 50 and peer["mean_latency_ms"] == pytest.approx(95.0)
    assert f["evidence"]["case"] == "slow_peer"
    assert PEER in f["summary"] and "95.0 ms each" in f["summary"], f["summary"]
    assert "95.0 ms per request" in f["recommendation"] and "prefetch" in f["recommendation"]


def test_a_poll_wait_is_network_io_only_where_the_thread_received_then(tmp_path):
    f = _top(_trace(tmp_path, kstack=POLL_STACK))
    assert f["category"] == "network_io"
    assert f["chain"][-1]["state"] == "network_io"
    quiet = build_report(_trace(tmp_path, kstack=POLL_STACK, traffic=False, name="quiet.parquet"))
    assert "network_io" not in {g["category"] for g in quiet["findings"]}, quiet["findings"]


def test_a_poll_wait_beside_unix_socket_traffic_is_no_network_wait(tmp_path):
    """A UNIX socket's peer is on this machine (a DataLoader's workers pass shared-memory
    descriptors through one while the trainer polls its result pipe): its traffic makes
    no poll wait a network wait."""
    local = build_report(_trace(tmp_path, kstack=POLL_STACK, family="unix"))
    assert "network_io" not in {g["category"] for g in local["findings"]}, local["findings"]


def test_retransmits_are_counted_per_peer(tmp_path):
    def lossy(s: Synth) -> None:
        for x in periodic(0.0, s.duration_s, 0.2):
            s.retransmit(x + 0.1, STORE, 3)
    peer = next(c for c in _top(_trace(tmp_path, lossy))["culprits"] if c["kind"] == "peer")
    assert peer["retransmits"] == 150


def _upload(s: Synth) -> None:
    """A checkpoint upload thread of the job sends 4 MiB every bucket on the same link."""
    s.thread(UPLOADER, "ckpt_upload")
    s.socket(UPLOADER, CKPT, "10.0.0.3:9000")
    for x in periodic(0.0, s.duration_s, 0.1):
        s.net_io(UPLOADER, x, CKPT, 4 * MiB, direction="send")
        s.net_device(x, "veth0", 4 * MiB, tid=UPLOADER, pid=100, comm="ckpt_upload")


def test_an_upload_on_the_same_interface_is_named_with_its_bytes_and_rate(tmp_path):
    f = _top(_trace(tmp_path, _upload))
    assert f["category"] == "network_io"
    assert f["evidence"]["case"] == "upload"
    up = next(c for c in f["culprits"] if c.get("uploader"))
    assert (up["kind"], up["name"], up["tid"]) == ("thread", "ckpt_upload", UPLOADER)
    # 4 MiB per 100 ms bucket, all through the waits: 40 MiB/s
    assert up["rate_bytes_per_s"] == pytest.approx(40 * MiB, rel=0.01)
    assert "while ckpt_upload (300) sent" in f["summary"] and "on veth0" in f["summary"], f["summary"]
    assert "41.9 MB/s" in f["summary"], f["summary"]
    rec = f["recommendation"]
    assert rec.startswith("ckpt_upload sends") and "cap the upload's concurrency and rate" in rec
    assert "between steps" in rec


def test_another_process_sending_on_the_interface_is_named(tmp_path):
    def aws(s: Synth) -> None:
        for x in periodic(0.0, s.duration_s, 0.1):
            s.net_device(x, "veth0", 3 * MiB, tid=777, pid=777, comm="aws")
            s.net_device(x, "eth1", 30 * MiB, tid=778, pid=778, comm="elsewhere")
    f = _top(_trace(tmp_path, aws))
    assert f["evidence"]["case"] == "upload"
    up = [c for c in f["culprits"] if c.get("uploader")]
    assert [(c["kind"], c["name"], c["pid"]) for c in up] == [("process", "aws", 777)]


def test_a_small_sender_beside_the_victims_own_traffic_is_no_upload(tmp_path):
    def chatter(s: Synth) -> None:
        for x in periodic(0.0, s.duration_s, 0.1):
            s.net_device(x, "veth0", 10_000, tid=777, pid=777, comm="ntp")
            s.net_device(x, "veth0", 2 * MiB)  # deferred transmissions, the loader's own among them
    f = _top(_trace(tmp_path, chatter))
    assert f["evidence"]["case"] == "slow_peer"


def test_unix_and_ipv6_peers_are_named_as_such(tmp_path):
    def names(s: Synth) -> None:
        s.socket(LOADER, STORE, "/run/store.sock", family="unix", protocol=0, interface="", ts=0.01)
    peer = next(c for c in _top(_trace(tmp_path, names))["culprits"] if c["kind"] == "peer")
    assert peer["name"] == "unix:/run/store.sock" and peer["family"] == "unix"

    def v6(s: Synth) -> None:
        s.socket(LOADER, STORE, "[fd00::2]:8080", family="ipv6", ts=0.01)
    peer = next(c for c in _top(_trace(tmp_path, v6, name="v6.parquet"))["culprits"] if c["kind"] == "peer")
    assert peer["name"] == "[fd00::2]:8080"


def test_a_socket_the_recorder_never_named_is_said_by_inode(tmp_path):
    s = Synth()
    _slow_store(s)
    s.rows["socket"].clear()
    s.gpu_from_running(TRAINER)
    peer = next(c for c in _top(analyze(s.read(tmp_path)))["culprits"] if c["kind"] == "peer")
    assert peer["name"] == f"socket {STORE}"


def test_the_reports_show_the_network(tmp_path):
    a = _trace(tmp_path, _upload)
    report = Report.of(a)
    text = render_text(report)
    assert "network_io" in text
    assert f"peer: {PEER}: waited" in text and "50 requests, 95 ms each on average" in text, text
    assert "upload: ckpt_upload (300, pid 100) sent" in text, text
    table = text[text.index("Threads (seconds per state):"):]
    assert "network_io" in table.splitlines()[1] and "net in" in table.splitlines()[1], table
    loader = next(line for line in table.splitlines() if line.strip().startswith(str(LOADER)))
    assert "52.4 MB" in loader, loader  # 50 MiB received
    doc = json.loads(render_json(report))
    row = next(t for t in doc["threads"] if t["tid"] == LOADER)
    assert row["network"] == {"recv_bytes": 50 * MiB, "send_bytes": 50 * 64}
    assert row["seconds"]["network_io"] == pytest.approx(4.75)
    html = render_html(report)
    assert "#0f8b8d" in html and PEER in html


def test_a_trace_without_network_rows_reads_as_before(tmp_path):
    f = _top(_trace(tmp_path, traffic=False))
    assert f["category"] == "network_io"  # the stack alone says so
    assert "network" not in f["evidence"] and "case" not in f["evidence"]
    assert not [c for c in f["culprits"] if c["kind"] == "peer"]


def test_peer_names_are_resolved_only_when_asked_and_never_hold_the_report():
    from trainbpf.reports.network import resolve_peers

    doc = {"findings": [{"culprits": [{"kind": "peer", "name": PEER}, {"kind": "peer", "name": "[fd00::2]:80"},
                                      {"kind": "peer", "name": "unix:/run/x.sock"}]}]}
    asked = []

    def lookup(address):
        asked.append(address)
        if address == "fd00::2":
            raise OSError("no name")
        return ("store.example", [], [address])
    resolve_peers(doc, lookup=lookup)
    culprits = doc["findings"][0]["culprits"]
    assert sorted(asked) == ["10.0.0.2", "fd00::2"]
    assert culprits[0]["host"] == "store.example" and "host" not in culprits[1] and "host" not in culprits[2]

    def hangs(address):
        time.sleep(5)
        return ("late.example", [], [address])
    t0 = time.monotonic()
    resolve_peers(doc := {"findings": [{"culprits": [{"kind": "peer", "name": "10.0.0.9:1"}]}]}, lookup=hangs,
                  timeout_s=0.2)
    assert time.monotonic() - t0 < 1.0 and "host" not in doc["findings"][0]["culprits"][0]


def test_health_writes_the_network_wait_per_top_peer(tmp_path):
    from test_health_outputs import parse_exposition
    from trainbpf.health.config import DEFAULT_THRESHOLDS, HealthConfig
    from trainbpf.health.outputs import render_textfile
    from trainbpf.health.results import HealthResult, grade_report
    from trainbpf.health.targets import Target

    report = build_report(_trace(tmp_path))
    f = report["findings"][0]
    # Five more peers than the labels hold: the smaller ones go under "other".
    f["culprits"] += [{"kind": "peer", "name": f"10.0.0.{i}:80", "seconds": 0.01 * i} for i in range(3, 8)]
    f["seconds"] += sum(0.01 * i for i in range(3, 8))
    target = grade_report(Target(100, "python", "python train.py", "device"), report, tids={TRAINER, LOADER},
                          thresholds=DEFAULT_THRESHOLDS)
    result = HealthResult(2, "node", 1.0, 2.0, "targets", [target], None, [], None, HealthConfig())
    samples = {k: v for k, v in parse_exposition(render_textfile(result)).items() if k[0] == "trainbpf_network_wait_seconds"}
    peers = {dict(labels)["peer"]: v for (_, labels), v in samples.items()}
    assert set(peers) == {PEER, "10.0.0.7:80", "10.0.0.6:80", "other"}, peers
    assert peers["other"] == pytest.approx(0.03 + 0.04 + 0.05 + f["seconds"] - sum(
        c["seconds"] for c in f["culprits"] if c["kind"] == "peer"), abs=1e-5)
    assert sum(peers.values()) == pytest.approx(f["seconds"], abs=1e-5)


def test_analyze_resolves_peer_names_only_with_resolve(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trainbpf.cli import app
    from trainbpf.reports import network

    s = Synth()
    _slow_store(s)
    s.gpu_from_running(TRAINER)
    path = s.write(tmp_path / "trace.parquet")
    asked = []
    monkeypatch.setattr(network.socket, "gethostbyaddr", lambda a: asked.append(a) or ("store.example", [], [a]))
    plain = CliRunner().invoke(app, ["analyze", str(path)])
    assert plain.exit_code == 0 and not asked and "store.example" not in plain.output
    named = CliRunner().invoke(app, ["analyze", str(path), "--resolve"])
    assert named.exit_code == 0 and asked == ["10.0.0.2"], named.output
    assert f"peer: {PEER} (store.example): waited" in named.output
    both = CliRunner().invoke(app, ["analyze", str(path), str(path), "--resolve"])
    assert both.exit_code != 0 and "trainbpf: error: --resolve applies to one trace" in both.output


def _gloo_job(s: Synth, ranks: int) -> None:
    """`ranks` ranks (pids 11, 12): each trainer runs, then waits in an all-reduce that
    its gloo thread ends; the gloo thread waits on its TCP socket to the other rank
    meanwhile.  Rank 1 computes 60 ms longer every step: the others wait for it."""
    for rank in range(ranks):
        pid, trainer, gloo, sock = 11 + rank, 11 + rank, 21 + rank, 7001 + rank
        s.thread(trainer, "python", pid=pid)
        s.thread(gloo, "pt_gloo_runloop", pid=pid)
        for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", ranks)):
            s.add("process_env", ts_ns=START, pid=pid, name=name, state=str(value))
        s.socket(gloo, sock, f"127.0.0.1:{29500 + (1 - rank)}", interface="lo")
        late = 0.06 if rank == 1 else 0.0
        for x in periodic(0.0, s.duration_s, 0.2):
            wait = 0.1 - late
            s.offcpu(trainer, x + 0.1 + late, wait - 0.001, waker=gloo, kstack=("schedule", "futex_wait_queue", "futex_wait"))
            s.futex(trainer, x + 0.1 + late, wait - 0.002, addr=0x7F00_0000_2000)
            s.offcpu(gloo, x + 0.1 + late, wait - 0.002, kstack=RECV_STACK)
            s.net_io(gloo, x + 0.1, sock, 4 * MiB)
            s.net_io(gloo, x + 0.1, sock, 4 * MiB, direction="send")


def test_a_gloo_threads_socket_waits_stay_collective_or_the_stragglers(tmp_path):
    s = Synth(target_pid=11, meta={"trainer_tid": None})
    _gloo_job(s, 2)
    s.gpu_from_running(11)
    report = build_report(analyze(s.read(tmp_path)))
    assert report["straggler"] is not None and report["straggler"]["rank"] == 1, report["straggler"]
    found = {f["category"]: f for f in report["findings"]}
    assert "network_io" not in found, [(f["category"], f["share"]) for f in report["findings"]]
    gloo_rows = [t for t in report["threads"] if t["comm"] == "pt_gloo_runloop"]
    assert all(t["seconds"].get("network_io", 0) > 0 for t in gloo_rows)  # their own time is network waits

    one = Synth(target_pid=11)
    _gloo_job(one, 1)  # one rank traced without its peers: its waits are the collective's own
    one.gpu_from_running(11)
    single = build_report(analyze(one.read(tmp_path, "one.parquet")))
    assert single["findings"][0]["category"] == "collective", [(f["category"], f["share"]) for f in single["findings"]]
    assert "network_io" not in {f["category"] for f in single["findings"]}
