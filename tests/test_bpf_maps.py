"""Reading the probes' BPF hashes from user space (tracer/collector.py): a batch drain, a
batch read and per-key lookups give the same entries of a real kernel map."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_env import require_root
from trainbpf.tracer import kheaders
from trainbpf.tracer.collector import drain_hash, lookup_keys, read_hash

MAP_SOURCE = """
struct value { u64 ts_ns; u32 tgid; s32 stack_id; };
BPF_HASH(entries, u32, struct value, 65536);
"""


@pytest.fixture
def table():
    require_root()
    kheaders.use_headers()
    from bcc import BPF

    bpf = BPF(text=MAP_SOURCE)
    try:
        yield bpf["entries"]
    finally:
        bpf.cleanup()


def fill(table, tids) -> None:
    for tid in tids:
        leaf = table.Leaf()
        leaf.ts_ns, leaf.tgid, leaf.stack_id = tid * 1000, tid // 10, -tid
        table[table.Key(tid)] = leaf


def test_a_read_a_lookup_and_a_drain_agree_and_only_the_drain_empties_the_map(table):
    tids = list(range(1, 5001, 7))  # more than one batch (BATCH_ENTRIES) in a map of 65536
    fill(table, tids)
    keys, values = read_hash(table)
    assert sorted(keys.tolist()) == tids
    order = np.argsort(keys)
    assert (values["ts_ns"][order] == np.array(tids) * 1000).all()
    assert (values["stack_id"][order] == -np.array(tids)).all()

    wanted = [tids[3], tids[-1], 999_999]  # the last is not in the map
    found, got = lookup_keys(table, wanted)
    assert found.tolist() == wanted[:2]
    assert got["tgid"].tolist() == [tids[3] // 10, tids[-1] // 10]
    assert len(table.items()) == len(tids), "a read leaves the entries"

    keys, values = drain_hash(table)
    assert sorted(keys.tolist()) == tids and (values["ts_ns"] == keys.astype(np.uint64) * 1000).all()
    assert len(table.items()) == 0
    keys, values = drain_hash(table)
    assert len(keys) == 0 and len(values) == 0 and values.dtype.names == ("ts_ns", "tgid", "stack_id")



def test_without_batch_operations_the_per_key_reads_give_the_same(table, monkeypatch):
    """Kernels without BPF_MAP_*_BATCH: bcc's per-key reads, and the drain deletes only
    what it read."""
    from trainbpf.tracer import collector

    def no_batches(*_a, **_k):
        raise OSError(22, "batch operations not supported")

    monkeypatch.setattr(collector, "_batches", no_batches)
    tids = [3, 5, 8]
    fill(table, tids)
    keys, values = read_hash(table)
    assert sorted(keys.tolist()) == tids and len(table.items()) == 3
    found, got = lookup_keys(table, [5, 6])
    assert found.tolist() == [5] and got["ts_ns"].tolist() == [5000]
    keys, values = drain_hash(table)
    assert sorted(keys.tolist()) == tids and sorted(values["tgid"].tolist()) == [0, 0, 0]
    assert len(table.items()) == 0
