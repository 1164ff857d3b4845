"""The cuda collector's pure parts: symbol aliases, library discovery in maps, and the
call table shared with probes/cuda.bpf.c."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np

from trainbpf.tracer.collectors.cuda import (
    CALLS,
    KINDS,
    LAUNCH_SLOTS,
    LAYERS,
    CudaCollector,
    base_name,
    cuda_libraries,
    thread_buckets,
)
from trainbpf.tracer.settings import Settings

PROBE = Path(__file__).resolve().parents[1] / "probes" / "cuda.bpf.c"


def test_aliases_map_to_their_base_call():
    assert base_name("cudaMemcpyAsync_ptsz") == "cudaMemcpyAsync"
    assert base_name("cudaMemcpy_ptds") == "cudaMemcpy"
    assert base_name("cuMemAlloc_v2") == "cuMemAlloc"
    assert base_name("cuMemcpyHtoDAsync_v2") == "cuMemcpyHtoDAsync"
    assert base_name("cuStreamSynchronize_ptsz") == "cuStreamSynchronize"
    assert base_name("cudaGetDeviceCount") is None
    assert base_name("cudaMallocPitch") is None  # not cudaMalloc with a suffix
    assert base_name("cudaMallocHost") == "cudaMallocHost"


def test_libraries_found_in_maps_once_per_file():
    wheel = "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    maps = "\n".join([
        f"7f0000000000-7f0000001000 r--p 00000000 fd:01 111 {wheel}",
        f"7f0000001000-7f0000002000 r-xp 00001000 fd:01 111 {wheel}",
        "7f0000003000-7f0000004000 r-xp 00000000 fd:01 222 /usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "7f0000005000-7f0000006000 r-xp 00000000 fd:01 333 /usr/lib/libcudnn.so.9",
        "7f0000007000-7f0000008000 r-xp 00000000 fd:01 444 /usr/local/cuda/lib64/libcudart.so",
        "7f0000009000-7f000000a000 rw-p 00000000 00:00 0 ",
    ])
    assert cuda_libraries(maps) == [
        (wheel, ("fd:01", 111)),
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", ("fd:01", 222)),
        ("/usr/local/cuda/lib64/libcudart.so", ("fd:01", 444)),
    ]


def test_call_table_matches_the_probe():
    """The probe compiles CALLS as the loader passes them (CUDA_CALLS: each symbol with its
    position as call code, its layer and kind, in the codes LAYER_* and CUDA_* name, and
    where its arguments are), and keeps no table of its own."""
    defines = CudaCollector(Settings()).defines()
    calls = re.findall(r"CALL\((\w+),(\d+),(\d+),(\d+),(\d+),(\d+),(\d+),(\d+)\)", str(defines["CUDA_CALLS"]))
    layer_of = {defines[f"LAYER_{layer.upper()}"]: layer for layer in LAYERS}
    kind_of = {defines[f"CUDA_{kind.upper()}"]: kind for kind in KINDS}
    assert [(name, int(code), layer_of[int(layer)], kind_of[int(kind)], int(arg), int(size), int(stream), int(src))
            for name, code, layer, kind, arg, size, stream, src in calls] == [
        (c.name, i, LAYERS[c.layer], KINDS[c.kind], c.arg, c.bytes, c.stream, c.src) for i, c in enumerate(CALLS)
    ]
    # every copy reads its source pointer (the second argument), no other call does
    assert {c.name: c.src for c in CALLS if c.src} == {c.name: 2 for c in CALLS if KINDS[c.kind] == "copy"}
    text = PROBE.read_text()
    assert not re.findall(r"^#define ARGS_", text, re.M), "the argument table lives in tracer/collectors/cuda.py CALLS"
    assert re.search(r"^CUDA_CALLS$", text, re.M) and '#error "CUDA_CALLS must be defined by the loader"' in text


def test_thread_buckets_read_each_slot_with_launches():
    """A thread's last bucket, still in its record at the stop: one row per slot (runtime,
    direct driver, nested driver) that counted launches, in the bucket ending at end_ns."""
    # the fields of struct cuda_thread that are read, as array_values gives them
    records = np.array([
        (30_000_000, [5, 0, 4], [21_000_000, 0, 21_000_100], 70, 7),
        (10_000_000, [0, 0, 0], [0, 0, 0], 80, 8),  # idle
        (0, [0, 3, 0], [0, 0, 0], 0, 0),  # never owned
    ], dtype=[("end_ns", "u8"), ("launches", "u8", 3), ("first_ns", "u8", 3), ("tid", "u4"), ("pid", "u4")])
    assert thread_buckets(records, 10_000_000) == [
        (2, 70, 7, 5, 21_000_000, 0, 0),
        (2, 70, 7, 4, 21_000_100, 1, 1),
    ]
    assert [(name, LAYERS[layer], nested) for name, layer, nested in LAUNCH_SLOTS] == [
        ("runtime", "runtime", 0), ("driver", "driver", 0), ("nested", "driver", 1)]
    defines = CudaCollector(Settings()).defines()
    assert [defines[f"CUDA_SLOT_{n}"] for n in ("RUNTIME", "DRIVER", "NESTED")] == [0, 1, 2]
    assert defines["CUDA_SLOTS"] == 3


def test_without_a_cuda_library_probed_no_map_is_read():
    """A process that maps no CUDA library (most flushes of most recordings) has no
    launches counted: the drain reads none of the probe's maps (a read of the 65,536-entry
    launch hash walks every bucket, ~0.2 ms a flush)."""
    import os

    from trainbpf.tracer.collector import ThreadTable

    class NoMaps(dict):
        def __getitem__(self, name):
            raise AssertionError(f"map {name} read")

    collector = CudaCollector(Settings())
    collector.threads = ThreadTable()
    collector.threads.tgid[os.getpid()] = os.getpid()  # this test's process maps no CUDA library
    assert collector.drain(NoMaps(), 10**9) == []
    assert collector.drain(NoMaps(), 2 * 10**9, final=True) == []
    assert not collector.libraries
