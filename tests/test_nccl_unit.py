"""The nccl collector's pure parts: library discovery in maps, the probed symbols and their
aliases, the call table shared with probes/nccl.bpf.c, and the `collective` rows."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from standins import build_standin
from trainbpf.trace.schema import KIND_NAMES, view_columns
from trainbpf.tracer.collectors.nccl import CALL_INDEX, CALLS, NCCL_LIBRARIES, NcclCollector
from trainbpf.tracer.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "probes" / "nccl.bpf.c"


def test_libraries_found_in_maps_once_per_file():
    wheel = "/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
    maps = "\n".join([
        f"7f0000000000-7f0000001000 r--p 00000000 fd:01 111 {wheel}",
        f"7f0000001000-7f0000002000 r-xp 00001000 fd:01 111 {wheel}",
        "7f0000003000-7f0000004000 r-xp 00000000 fd:01 222 /usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5",
        "7f0000005000-7f0000006000 r-xp 00000000 fd:01 333 /usr/lib/libnccl-net.so",  # a network plugin
        "7f0000007000-7f0000008000 r-xp 00000000 fd:01 444 /opt/nccl/lib/libnccl.so",
        "7f0000009000-7f000000a000 r-xp 00000000 fd:01 555 /usr/local/cuda/lib64/libcudart.so.12",
    ])
    assert [(m.path, m.file) for m in NCCL_LIBRARIES.mappings(maps)] == [
        (wheel, ("fd:01", 111)),
        ("/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5", ("fd:01", 222)),
        ("/opt/nccl/lib/libnccl.so", ("fd:01", 444)),
    ]
    assert all(NCCL_LIBRARIES.marker in m.path for m in NCCL_LIBRARIES.mappings(maps))


def test_profiling_names_map_to_their_call():
    assert NCCL_LIBRARIES.base_name("pncclAllReduce") == "ncclAllReduce"
    assert NCCL_LIBRARIES.base_name("ncclGroupEnd") == "ncclGroupEnd"
    assert NCCL_LIBRARIES.base_name("ncclGroupStart") is None  # nothing waits in it
    assert NCCL_LIBRARIES.base_name("ncclCommInitRank") is None
    assert NCCL_LIBRARIES.base_name("ncclSendRecv") is None  # not ncclSend with a suffix


def test_stand_in_exports_each_call_once(tmp_path):
    """NCCL's builds export every call twice, nccl* and pnccl* at one address: one probe
    each, under the base name, or every call would be counted twice."""
    library = build_standin("fake-nccl", tmp_path / "wheel")
    assert NCCL_LIBRARIES.exported(str(library)) == sorted((c.name, c.name) for c in CALLS)


def test_call_table_matches_the_probe():
    """The probe compiles CALLS as the loader passes them (NCCL_CALLS: each symbol with its
    position as call code and where its arguments are), and keeps no table of its own."""
    defines = NcclCollector(Settings()).defines()
    calls = re.findall(r"NCCL_CALL\((\w+),(\d+),(\d+),(\d+)\)", str(defines["NCCL_CALLS"]))
    assert [(name, *map(int, numbers)) for name, *numbers in calls] == [
        (c.name, i, c.comm, c.elements) for i, c in enumerate(CALLS)]
    text = PROBE.read_text()
    assert not re.findall(r"^#define ARGS_", text, re.M), "the argument table lives in tracer/collectors/nccl.py CALLS"
    assert re.search(r"^NCCL_CALLS$", text, re.M)


def test_records_become_collective_rows():
    dtype = np.dtype([("ts_ns", "<u8"), ("dur_ns", "<u8"), ("seq", "<u8"), ("comm", "<u8"), ("elements", "<u8"),
                      ("ret", "<i8"), ("tid", "<u4"), ("pid", "<u4"), ("name", "<u4"), ("pad", "<u4")])
    records = np.array([(100, 5_000_000, 0, 0x7f00dead0000, 1024, 0, 11, 10, CALL_INDEX["ncclAllReduce"], 0),
                        (6_000_000, 40, 1, 0, 0, 5, 11, 10, CALL_INDEX["ncclGroupEnd"], 0)], dtype=dtype)
    (batch,) = NcclCollector(Settings()).decode("nccl_events", records)
    rows = pa.Table.from_batches([batch]).to_pylist()
    assert {r["kind"] for r in rows} == {"collective"}
    assert [(r["ts_ns"], r["dur_ns"], r["tid"], r["pid"], r["name"], r["op"], r["addr"], r["size"], r["count"])
            for r in rows] == [(100, 5_000_000, 11, 10, "ncclAllReduce", 0, 0x7f00dead0000, 1024, 0),
                               (6_000_000, 40, 11, 10, "ncclGroupEnd", 1, 0, 0, 5)]
    assert view_columns("collective") == ("ts_ns", "dur_ns", "tid", "pid", "name", "seq", "comm", "elements", "ret")
    assert KIND_NAMES["collective"] == {"op": "seq", "addr": "comm", "size": "elements", "count": "ret"}
