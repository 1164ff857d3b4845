"""The network kinds (issue 30) on one real recording: a traced fetcher in one network
namespace asks a store in another, across a veth pair, for batches over IPv4, IPv6 and
a UNIX socket; the store answers each request 30 ms late, drops part of its answers on
one port (a BPF program on the veth's egress: retransmits), and closes one connection
while the fetcher waits on it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_env import require_root
from netns_env import two_nodes
from recording import record_workload
from trainbpf.tracer.kheaders import use_headers

HERE = Path(__file__).parent
PORT, DROP_PORT = 8080, 8081
ANSWER_NS = 30_000_000
# One in DROP_ONE_IN of the fetcher's data packets to DROP_PORT (its uploads) is dropped
# as the store's veth receives it (`dropped[0]` counts them): its socket sends each
# again.  Dropped on the fetcher's own egress instead, TCP would be told and send it
# anew, not as a retransmit.
DROP_ONE_IN = 5
DROPPER = """
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
BPF_ARRAY(dropped, u64, 2); /* [0] dropped, [1] data packets seen */
int drop_requests(struct __sk_buff *skb)
{
    if (skb->protocol != bpf_htons(ETH_P_IP))
        return TC_ACT_OK;
    u8 ihl = 0, doff = 0;
    u16 dport = 0;
    bpf_skb_load_bytes(skb, ETH_HLEN, &ihl, 1);
    u32 tcp = ETH_HLEN + (ihl & 0xf) * 4;
    bpf_skb_load_bytes(skb, tcp + 2, &dport, 2);
    bpf_skb_load_bytes(skb, tcp + 12, &doff, 1);
    if (bpf_ntohs(dport) != DROP_PORT || skb->len < tcp + (doff >> 4) * 4 + 1000) /* not an upload's */
        return TC_ACT_OK;
    int seen = 1, drop = 0;
    u64 *n = dropped.lookup(&seen);
    if (!n || __sync_fetch_and_add(n, 1) % DROP_ONE_IN != DROP_ONE_IN - 1)
        return TC_ACT_OK;
    u64 *d = dropped.lookup(&drop);
    if (d)
        __sync_fetch_and_add(d, 1);
    return TC_ACT_SHOT;
}
"""


def drop_uploads(store):
    """A clsact qdisc on the store's veth whose ingress filter drops part of the uploads
    to DROP_PORT; the BPF object must be kept while it should drop."""
    from bcc import BPF
    from pyroute2 import NetNS

    use_headers()
    bpf = BPF(text=DROPPER, cflags=[f"-DDROP_PORT={DROP_PORT}", f"-DDROP_ONE_IN={DROP_ONE_IN}"])
    fn = bpf.load_func("drop_requests", BPF.SCHED_CLS)
    with NetNS(store.netns) as ns:
        index = ns.link_lookup(ifname=store.ifname)[0]
        ns.tc("add", "clsact", index)
        ns.tc("add-filter", "bpf", index, ":1", fd=fn.fd, name=fn.name, parent="ffff:fff2", classid=1,
              direct_action=True)
    return bpf


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    require_root()
    folder = tmp_path_factory.mktemp("net")
    unix_path = str(folder / "store.sock")
    with two_nodes(ipv6=True) as (client, store):
        server = subprocess.Popen([*store.enter(), sys.executable, str(HERE / "net_server.py"), unix_path,
                                   f"{store.address}:{PORT}", f"{store.address}:{DROP_PORT}",
                                   f"[{store.address_v6}]:{PORT}"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "listening"
            dropper = drop_uploads(store)
            rec = record_workload(folder / "trace.parquet", "", probes=["net"], timeout=60, command=[
                *client.enter(), sys.executable, str(HERE / "net_workload.py"), store.address, store.address_v6,
                str(PORT), str(DROP_PORT), unix_path])
            dropped = int(dropper["dropped"][0].value)
            dropper.cleanup()
        finally:
            server.stdin.close()
            server.kill()
            server.wait()
    return rec, client, store, unix_path, dropped


def _sockets(rec) -> dict:
    """socket inode -> its last row."""
    rows = rec.trace.view("socket").sort_values("ts_ns")
    return {int(r.socket): r for r in rows.itertuples()}


def test_each_socket_is_named_by_its_peer_and_interface(net):
    rec, client, store, unix_path, _ = net
    sockets = _sockets(rec)
    done = rec.tids
    expected = {
        "ipv4": ("ipv4", f"{store.address}:{PORT}", 6, client.ifname),
        "dropped": ("ipv4", f"{store.address}:{DROP_PORT}", 6, client.ifname),
        "closed": ("ipv4", f"{store.address}:{PORT}", 6, client.ifname),
        "ipv6": ("ipv6", f"[{store.address_v6}]:{PORT}", 6, client.ifname),
        "unix": ("unix", unix_path, 0, ""),
    }
    for name, (family, peer, protocol, interface) in expected.items():
        row = sockets.get(done[name]["socket"])
        assert row is not None, f"no socket row for {name}: {rec.trace.view('socket').to_string()}"
        assert (row.family, row.peer, row.protocol, row.interface) == (family, peer, protocol, interface), name
        assert row.tid == done["tid"] and row.pid == rec.pid


def test_a_socket_connected_later_is_described_again(net):
    """A UDP socket sent on unconnected, then connected: a row without a peer, then one
    naming it; the last row names the socket now."""
    rec, _, store, *_ = net
    rows = rec.trace.view("socket")
    udp = rows[rows.socket == rec.tids["udp"]["socket"]].sort_values("ts_ns")
    assert list(udp.peer) == ["", f"{store.address}:9"], rows.to_string()
    assert (udp.family == "ipv4").all() and (udp.protocol == 17).all()


def test_bytes_and_calls_are_the_fetchers_own(net):
    """net_io's bytes are exactly what the fetcher sent and received on each socket."""
    rec, *_ = net
    io = rec.trace.view("net_io")
    width = rec.trace.meta["thresholds"]["net_bucket_ns"]
    assert (io.dur_ns == width).all() and (io.ts_ns % width == 0).all()
    assert not io.duplicated(["ts_ns", "tid", "socket", "direction"]).any()  # a bucket cut by a flush is one row
    mine = io[io.tid == rec.tids["tid"]]
    for name in ("ipv4", "ipv6", "unix", "dropped", "closed", "udp"):
        done = rec.tids[name]
        on = mine[mine.socket == done["socket"]]
        assert on[on.direction == "send"].bytes.sum() == done["sent"], (name, on.to_string())
        assert on[on.direction == "recv"].bytes.sum() == done["received"], (name, on.to_string())
        assert on.calls.min() > 0
    assert rec.trace.meta["lost"]["net"] == 0


def test_each_request_waits_for_the_stores_answer(net):
    rec, *_ = net
    req = rec.trace.view("net_request")
    for name, requests in (("ipv4", 4), ("ipv6", 2), ("unix", 2), ("dropped", 3)):
        on = req[req.socket == rec.tids[name]["socket"]]
        assert on.requests.sum() == requests, (name, req.to_string())
        assert on.latency_ns.sum() >= requests * ANSWER_NS
        assert (on.max_latency_ns >= ANSWER_NS).all() and (on.latency_ns >= on.max_latency_ns).all()


def test_retransmits_of_the_dropped_uploads(net):
    """The upload's packets dropped on the veth are sent again: the fetcher's socket, and
    only it, has retransmit rows."""
    rec, *_, dropped = net
    rt = rec.trace.view("retransmit")
    assert dropped > 0
    on = rt[rt.socket == rec.tids["dropped"]["socket"]]
    # a retransmit may resend several dropped segments at once, or be dropped itself
    assert 0 < on.retransmits.sum() <= 2 * dropped, rt.to_string()
    assert set(rt.socket) == {rec.tids["dropped"]["socket"]}
    width = rec.trace.meta["thresholds"]["net_bucket_ns"]
    assert (rt.dur_ns == width).all() and not rt.duplicated(["ts_ns", "socket"]).any()


def test_the_veths_packets_name_the_sender(net):
    rec, client, *_ = net
    dev = rec.trace.view("net_device")
    veth = dev[dev.interface == client.ifname]
    sent = veth[(veth.direction == "xmit") & (veth.tid == rec.tids["tid"])]
    assert (sent.pid == rec.pid).all() and sent.bytes.sum() > 0, veth.to_string()
    received = veth[veth.direction == "recv"]
    assert received.bytes.sum() >= rec.tids["ipv4"]["received"] and (received.tid == 0).all()
    assert received.pid.isna().all() and (received.comm == "").all()


def test_the_fetchers_waits_read_as_network_io(net):
    """Its waits for the store's answers are network_io stacks (a TCP or UNIX receive),
    and poll_wait where it waited in select first."""
    from trainbpf.analyzers.causes.stack_reading import STACK_CLASSES, classify_stacks, stack_class_codes

    rec, *_ = net
    off = rec.trace.view("offcpu")
    waits = off[(off.tid == rec.tids["tid"]) & (off.dur_ns >= ANSWER_NS * 0.9)]
    classes = [STACK_CLASSES[c] for c in stack_class_codes(classify_stacks(rec.trace.view("stack")), waits.kstack_id)]
    assert classes.count("network_io") >= 4 + 2 + 3 and classes.count("poll_wait") == 2, classes
    assert set(classes) <= {"network_io", "poll_wait", ""}, classes


def test_a_socket_closed_while_waited_on_keeps_its_rows(net):
    """The store closed the connection while the fetcher waited for its answer: the
    socket keeps its row and its request's bytes, and no answer is counted."""
    rec, *_ = net
    closed = rec.tids["closed"]
    assert closed["received"] == 0
    assert closed["socket"] in _sockets(rec)
    io = rec.trace.view("net_io")
    assert io[(io.socket == closed["socket"]) & (io.direction == "send")].bytes.sum() == closed["sent"]
    req = rec.trace.view("net_request")
    assert req[req.socket == closed["socket"]].empty


def test_peer_names_of_each_family():
    from trainbpf.tracer.collectors.net import peer_name

    assert peer_name(socket.AF_INET, bytes([10, 0, 0, 2]) + bytes(104), 4, 8080) == "10.0.0.2:8080"
    v6 = bytes.fromhex("fd000000000000000000000000000002")
    assert peer_name(socket.AF_INET6, v6 + bytes(92), 16, 443) == "[fd00::2]:443"
    assert peer_name(socket.AF_UNIX, b"/run/x.sock\0".ljust(108, b"\0"), 12, 0) == "/run/x.sock"
    assert peer_name(socket.AF_UNIX, b"\0store\0x".ljust(108, b"\0"), 6, 0) == "@store"  # its length ends it
    assert peer_name(socket.AF_UNIX, bytes(108), 0, 0) == ""
    assert peer_name(socket.AF_PACKET, bytes(108), 0, 0) == ""
    assert peer_name(socket.AF_INET, bytes(108), 4, 0) == ""  # not connected: no peer


def test_an_unseen_users_packets_are_counted_unnamed():
    """Under sudo with hidepid: another user's sending task keeps its counts, not its name."""
    from trainbpf.tracer.collectors.net import device_batches

    import numpy as np

    rows = {"bucket": np.array([10, 10]), "ifname": np.array(["eth0", "eth0"], dtype=object),
            "direction": np.array([1, 0]), "tid": np.array([4242, 0]), "bytes": np.array([3000, 1500]),
            "packets": np.array([2, 1]), "pid": np.array([4240, 0]), "comm": np.array(["upload", ""], dtype=object)}
    frame = device_batches(rows, 100_000_000, visible=lambda pid: False)[0].to_pandas()
    assert list(frame.tid) == [0, 0] and frame.pid.isna().all() and list(frame.comm) == ["", ""]
    assert list(frame["size"]) == [3000, 1500] and list(frame.state) == ["xmit", "recv"]
    seen = device_batches(rows, 100_000_000)[0].to_pandas()
    assert list(seen.tid) == [4242, 0] and seen.pid.iloc[0] == 4240 and seen.pid.isna().iloc[1]


def test_struct_offsets_come_from_the_kernels_btf(tmp_path):
    """struct sock's fields where this kernel has them, not where the headers bcc compiles
    against put them; a kernel without BTF gives none, and the probe counts no socket."""
    from trainbpf.tracer.collectors.net import KERNEL_FIELDS, NetCollector
    from trainbpf.tracer.kernel_btf import BTF_VMLINUX, field_offsets
    from trainbpf.tracer.settings import Settings

    if not BTF_VMLINUX.exists():
        pytest.skip("this kernel has no BTF")
    offsets = field_offsets(KERNEL_FIELDS)
    assert offsets is not None and offsets["OFF_SKC_DADDR"] == 0 and offsets["OFF_SKC_DPORT"] == 12
    assert offsets["OFF_UNIX_ADDRESS_PATH"] == offsets["OFF_UNIX_ADDRESS_LEN"] + 4 + 2  # name[].sun_path
    assert NetCollector(Settings()).defines()["NET_OFFSETS"] == 1
    (tmp_path / "vmlinux").write_bytes(b"not btf")
    assert field_offsets(KERNEL_FIELDS, tmp_path / "vmlinux") is None
    assert field_offsets({"X": ("sock", "no_such_field")}) is None


def test_net_bucket_is_a_millisecond_at_least(monkeypatch):
    from trainbpf.trace.errors import UsageError
    from trainbpf.tracer.settings import Settings

    with pytest.raises(UsageError, match="net_bucket_ns"):
        Settings(net_bucket_ns=1000)
    monkeypatch.setenv("TRAINBPF_NET_BUCKET_NS", "20000000")
    assert Settings().net_bucket_ns == 20_000_000
    monkeypatch.setenv("TRAINBPF_NET_BUCKET_NS", "soon")
    with pytest.raises(UsageError, match="TRAINBPF_NET_BUCKET_NS"):
        Settings()
