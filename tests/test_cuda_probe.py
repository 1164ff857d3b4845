"""The cuda probe on real uprobes: the stand-in CUDA runtime and driver
(scripts/fake-cuda, built into a pip-wheel-like tree) loaded after the recording
started, and the real libcudart where the machine has one."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_env import require_root
from kernel_workloads import CUDA_FREE_MS, CUDA_LAUNCHES, CUDA_WAIT_MS
from recording import record_cli, record_workload
from standins import build_standin
from trainbpf.analyzers.timeline.cuda_calls import gpu_waits
from trainbpf.analyzers.pipeline import analyze
from trainbpf.tracer.settings import Settings

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    require_root()
    tmp = tmp_path_factory.mktemp("cuda")
    runtime = build_standin("fake-cuda", tmp / "wheel")
    rec = record_workload(tmp / "trace.parquet", "cuda_fake", runtime)
    rec.runtime = runtime
    return rec


def test_library_found_after_start_and_recorded_in_metadata(fake):
    libs = fake.trace.meta["cuda"]["libraries"]
    by_name = {Path(lib["path"]).name: lib for lib in libs}
    assert set(by_name) == {"libcudart.so.12", "libcuda.so.1"}, libs
    rt, drv = by_name["libcudart.so.12"], by_name["libcuda.so.1"]
    assert "site-packages/nvidia/cuda_runtime/lib" in rt["path"]
    assert {"cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaStreamSynchronize_ptsz",
            "cudaMemcpyAsync_ptsz"} <= set(rt["symbols"])
    assert {"cuLaunchKernel", "cuMemAlloc_v2", "cuMemcpyHtoD_v2", "cuStreamSynchronize_ptsz"} <= set(drv["symbols"])
    assert "cudaGetDeviceCount" not in rt["symbols"] and not rt["failed"] and not drv["failed"]
    assert fake.pid in rt["pids"]
    assert fake.result.cuda_libraries == 2


def test_launch_counts_exact_per_thread(fake):
    launches = fake.trace.frame("cuda_launch")
    issued = launches[launches.op == 0].groupby("tid")["count"].sum().to_dict()
    main, thread, child = fake.tids["main"], fake.tids["driver_thread"], fake.tids["child"]
    expected = {
        main: CUDA_LAUNCHES["runtime"] + CUDA_LAUNCHES["runtime_ptsz"] + len(CUDA_WAIT_MS),
        thread: CUDA_LAUNCHES["driver_thread"],
        child: CUDA_LAUNCHES["child"],
    }
    assert issued == expected
    # the runtime's own cuLaunchKernel calls: nested driver launches, one per runtime launch
    runtime = launches[(launches.name == "runtime")].groupby("tid")["count"].sum().to_dict()
    nested = launches[launches.op == 1].groupby("tid")["count"].sum().to_dict()
    assert nested == runtime == {main: expected[main], child: expected[child]}
    assert set(launches[launches.tid == thread].name) == {"driver"}
    # each row spans from its bucket's first launch to the bucket's end
    end = launches.ts_ns + launches.dur_ns
    assert (end % 10_000_000 == 0).all() and (launches.dur_ns > 0).all() and (launches.dur_ns <= 10_000_000).all()
    # a thread's bucket is counted in its record and moved out whole: one row per bucket
    assert not launches.assign(end=end).duplicated(["tid", "name", "op", "end"]).any()
    assert (launches[launches.tid == child].pid == child).all()


def test_launch_counts_exact_when_threads_share_one_record(tmp_path):
    """Threads whose tids meet at the same record (here all of them: one record) take it
    over in turn, each moving the owner's bucket out first: the counts stay exact."""
    require_root()
    runtime = build_standin("fake-cuda", tmp_path / "wheel")
    rec = record_workload(tmp_path / "trace.parquet", "cuda_fake", runtime, settings=Settings(cuda_thread_records=1))
    launches = rec.trace.frame("cuda_launch")
    issued = launches[launches.op == 0].groupby("tid")["count"].sum().to_dict()
    main = rec.tids["main"]
    assert issued == {
        main: CUDA_LAUNCHES["runtime"] + CUDA_LAUNCHES["runtime_ptsz"] + len(CUDA_WAIT_MS),
        rec.tids["driver_thread"]: CUDA_LAUNCHES["driver_thread"],
        rec.tids["child"]: CUDA_LAUNCHES["child"],
    }
    nested = launches[launches.op == 1].groupby("tid")["count"].sum().to_dict()
    assert nested == {t: n for t, n in issued.items() if t != rec.tids["driver_thread"]}


def test_waits_within_1ms_of_truth(fake):
    calls = fake.trace.frame("cuda_call")
    runtime_waits = calls[(calls.state == "wait") & (calls.op == 0)]
    errors = []
    for (t0, t1), name in zip(fake.tids["waits"],
                                  ["cudaStreamSynchronize", "cudaDeviceSynchronize"] * 3):
        inside = runtime_waits[(runtime_waits.ts_ns >= t0) & (runtime_waits.ts_ns <= t1)]
        assert list(inside.name) == [name], inside
        dur = int(inside.dur_ns.iloc[0])
        errors.append(abs(dur - (t1 - t0)))  # the truth: the caller's own span of the call
        assert dur <= t1 - t0
        assert int(inside["count"].iloc[0]) == 0
        if name == "cudaStreamSynchronize":
            assert int(inside.addr.iloc[0]) == 0x5757
    assert max(errors) < 1e6, errors
    print(f"wait errors vs the caller's span (us): {[round(e / 1e3, 1) for e in errors]}")
    driver = calls[(calls.state == "wait") & (calls.op == 1)]
    assert {"cuStreamSynchronize", "cuCtxSynchronize"} <= set(driver.name)


def test_copies_and_allocations(fake):
    calls = fake.trace.frame("cuda_call")
    main = calls[calls.tid == fake.tids["main"]]
    copy = main[main.name == "cudaMemcpy"]
    assert len(copy) == 1 and int(copy["size"].iloc[0]) == 20_000_000
    assert 1.8e6 < int(copy.dur_ns.iloc[0]) < 4e6
    assert (main[main.name == "cuMemcpy"].op == 1).all() and len(main[main.name == "cuMemcpy"]) == 1
    assert (calls.dur_ns >= Settings().min_cuda_ns).all()
    # Whether these short calls pass the 20 us threshold depends on the uprobes' own cost;
    # where they do, their arguments are right.
    for name, col, value in (("cudaMalloc", "size", 1 << 20), ("cudaMemcpyAsync", "size", 1 << 20),
                             ("cudaMemcpyAsync", "addr", 0x5757), ("cuMemAlloc", "size", 1 << 20)):
        assert (main.loc[main.name == name, col].astype("int64") == value).all(), name
    assert (main.ustack_id >= 0).all()


def test_cuda_free_waits_for_the_device_and_counts_as_a_gpu_wait(fake):
    t0, t1 = fake.tids["free"]
    assert t1 - t0 >= CUDA_FREE_MS * 1e6 * 0.9  # the stand-in's cudaFree drained the queued copy
    waits = gpu_waits(fake.trace.view("cuda_call"), tids=[fake.tids["main"]])
    free = waits[waits["name"] == "cudaFree"]
    assert len(free) == 1, waits
    dur = int(free["end_ns"].iloc[0] - free["start_ns"].iloc[0])
    assert 0.9 * CUDA_FREE_MS * 1e6 <= dur <= t1 - t0


def test_pinned_host_allocations_and_frees(fake):
    """cudaHostAlloc (through the driver's cuMemHostAlloc) and cudaFreeHost are probed:
    an allocation with its size and the pointer it returned, a free with its pointer."""
    rt, drv = ({Path(lib["path"]).name: lib for lib in fake.trace.meta["cuda"]["libraries"]}[name]["symbols"]
               for name in ("libcudart.so.12", "libcuda.so.1"))
    assert {"cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaMallocAsync", "cudaFreeAsync"} <= set(rt), rt
    assert "cuMemHostAlloc" in drv, drv
    calls = fake.trace.frame("cuda_call")
    main = calls[calls.tid == fake.tids["main"]].set_index("name")
    assert main.loc["cudaHostAlloc", "state"] == "alloc" and int(main.loc["cudaHostAlloc", "size"]) == 1 << 20
    assert main.loc["cuMemHostAlloc", "state"] == "alloc" and int(main.loc["cuMemHostAlloc", "op"]) == 1
    assert main.loc["cudaFreeHost", "state"] == "free"
    assert int(main.loc["cudaFreeHost", "addr"]) == fake.tids["host_ptr"]
    assert int(main.loc["cudaHostAlloc", "addr"]) == int(main.loc["cuMemHostAlloc", "addr"]) == fake.tids["host_ptr"]


def test_pinned_buffer_paired_with_its_free(fake):
    """The analysis pairs the recorded cudaHostAlloc with the cudaFreeHost of its pointer:
    one pinned 1 MiB buffer, allocated and freed by the main thread."""
    table = analyze(fake.trace).lifetimes
    [row] = table[table["memory"] == "cuda_host"].itertuples()
    assert (row.size_class, row.buffers, row.freed, row.alive_max) == (1 << 20, 1, 1, 1), table
    assert row.map_tid == row.unmap_tid == fake.tids["main"] and 0 < row.lifetime_s < 0.1, table


def test_no_ring_buffer_traffic_for_launches(fake):
    """Launch counting goes through the hash only: every cuda_call row is a wait/copy."""
    calls = fake.trace.frame("cuda_call")
    assert set(calls.state) <= {"wait", "copy", "alloc", "free"}
    assert fake.trace.meta["lost"].get("cuda", 0) == 0


REAL = sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so.*[0-9]"))


def test_real_libcudart(tmp_path):
    require_root()
    if not REAL:  # these machines ship one; in CI its absence is a broken machine, not a pass
        reason = "no real libcudart under /usr/local/cuda*/lib*"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    rec = record_workload(tmp_path / "trace.parquet", "cuda_real", REAL[-1],
                          settings=Settings(min_cuda_ns=0))
    libs = rec.trace.meta["cuda"]["libraries"]
    assert len(libs) == 1 and libs[0]["path"].startswith("/usr/local/cuda")
    assert {"cudaMalloc", "cudaFree", "cudaDeviceSynchronize", "cudaStreamSynchronize",
            "cudaLaunchKernel", "cudaMemcpyAsync_ptsz"} <= set(libs[0]["symbols"])
    calls = rec.trace.frame("cuda_call")
    mine = calls[calls.tid == rec.tids["main"]].set_index("name")
    print({n: (int(mine.loc[n, "count"]), int(mine.loc[n, "dur_ns"])) for n in mine.index})
    for name in ("cudaMalloc", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaFree"):
        assert name in mine.index, f"{name} not recorded: {list(mine.index)}"
        assert int(mine.loc[name, "count"]) == rec.tids[name] != 0  # the error, without a driver
    assert int(mine.loc["cudaStreamSynchronize", "addr"]) == 0x5757
    assert int(mine.loc["cudaMalloc", "size"]) == 1 << 20


def test_record_says_which_libraries_it_probed(fake, tmp_path):
    """One line per CUDA library attached, or one saying none is mapped."""
    with_cuda = subprocess.Popen([sys.executable, "-c",
                                  f"import ctypes, time; ctypes.CDLL({str(fake.runtime)!r}); print(flush=True); "
                                  "time.sleep(60)"], stdout=subprocess.PIPE)
    without = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with_cuda.stdout.readline()  # loaded
        lines = [ln for ln in record_cli(tmp_path, "cuda", with_cuda.pid).splitlines() if ln.startswith("cuda:")]
        assert len(lines) == 2 and any("libcudart.so.12" in ln for ln in lines) \
            and any("libcuda.so.1" in ln for ln in lines), lines
        assert "cuda: no CUDA library" in record_cli(tmp_path, "cuda", without.pid)
    finally:
        for p in (with_cuda, without):
            p.kill()
            p.wait()


def test_library_only_visible_in_the_process_mount_namespace(fake, tmp_path):
    """A container's library: its path exists only in the process's mount namespace, so
    the recorder must open it through /proc/PID/root."""
    hidden = tmp_path / "ns"
    hidden.mkdir()
    runtime = hidden / Path(fake.runtime).relative_to(Path(fake.runtime).parents[4])
    script = (
        f"import ctypes, sys, time; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
        "from kernel_workloads import wait_for_uprobes; "
        f"rt = ctypes.CDLL({str(runtime)!r}); print(flush=True); "
        "wait_for_uprobes(rt, ['cudaGraphLaunch'], timeout=30); "
        "[rt.cudaGraphLaunch(None, None) for _ in range(7)]; print(flush=True); time.sleep(60)"
    )
    setup = (f"mount -t tmpfs none {hidden} && cp -r {Path(fake.runtime).parents[4]}/site-packages {hidden}/ "
             f"&& exec {sys.executable} -c \"{script}\"")
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", setup],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "\n"  # loaded
        assert not runtime.exists()  # not from here
        trainbpf = Path(sys.executable).with_name("trainbpf")
        out = tmp_path / "trace.parquet"
        rec = subprocess.Popen([str(trainbpf), "record", "--pid", str(proc.pid), "--duration", "4", "--gpu", "off",
                                "--probes", "cuda", "-o", str(out)], stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "\n"  # launched
        _, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
    finally:
        proc.kill()
        proc.wait()
    from trainbpf.trace.reader import read_trace

    trace = read_trace(out)
    assert [lib["path"] for lib in trace.meta["cuda"]["libraries"] if "cudart" in lib["path"]] == [str(runtime)]
    launches = trace.frame("cuda_launch")
    assert int(launches[(launches.name == "runtime") & (launches.op == 0)]["count"].sum()) == 7
