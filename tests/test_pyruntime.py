"""tracer.pyruntime against real CPython processes: _PyRuntime found by the ELF reader,
the thread list read through /proc/PID/mem, and the self-test refusing a skewed offset."""

from __future__ import annotations

import os
import subprocess
import time
from collections import defaultdict

import pytest

from tests.kernel_env import PYENV, PYTHON_VERSIONS, python_interpreter, require_root
from trainbpf.tracer.symbols import pyruntime
from trainbpf.tracer.symbols.elf import ElfSymbols

# A main thread in time.sleep (GIL released) and a second thread, so the list has two.
WORKLOAD = ("import threading, time\n"
            "t = threading.Thread(target=time.sleep, args=(30,)); t.start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")


@pytest.fixture
def sleeper(request):
    require_root("reads another process's memory")
    proc = subprocess.Popen([python_interpreter(request.param), "-c", WORKLOAD],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 5
    while len(os.listdir(f"/proc/{proc.pid}/task")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield request.param, proc
    proc.kill()
    proc.wait()


@pytest.mark.kernel
@pytest.mark.parametrize("sleeper", list(PYTHON_VERSIONS), indirect=True)
def test_thread_list_matches_tasks(sleeper):
    version, proc = sleeper
    py = pyruntime.attach(proc.pid)
    assert py.version == version
    assert set(py.threads) == {int(t) for t in os.listdir(f"/proc/{proc.pid}/task")}
    assert len(set(py.threads.values())) == 2


@pytest.mark.kernel
@pytest.mark.parametrize("sleeper", ["3.11", "3.12", "3.13"], indirect=True)
@pytest.mark.parametrize("field", ["ts.next", "ts.native_thread_id", "frame.executable",
                                   "code.name", "code.qualname", "code.filename"])
def test_skewed_offset_fails_self_test(sleeper, field):
    version, proc = sleeper
    with pytest.raises(pyruntime.PyRuntimeError, match=f"^CPython {version}: "):
        pyruntime.attach(proc.pid, corrupt=field)


@pytest.mark.kernel
@pytest.mark.parametrize("sleeper", ["3.10"], indirect=True)
@pytest.mark.parametrize("field", ["ts.next", "ts.thread_id", "frame.executable", "code.name", "code.filename"])
def test_skewed_offset_fails_self_test_310(sleeper, field):
    """3.10 has no co_qualname and finds each tid through glibc's struct pthread."""
    version, proc = sleeper
    with pytest.raises(pyruntime.PyRuntimeError, match=f"^CPython {version}: "):
        pyruntime.attach(proc.pid, corrupt=field)


@pytest.mark.kernel
@pytest.mark.parametrize("sleeper", ["3.10"], indirect=True)
def test_310_tid_found_in_struct_pthread(sleeper):
    """The one offset of glibc's struct pthread where every thread's tid lies."""
    version, proc = sleeper
    py = pyruntime.attach(proc.pid)
    assert py.version == "3.10" and py.offsets["pthread.tid"] % 4 == 0
    assert sorted(py.threads) == sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))


def test_elf_symbol_absent_in_non_python(tmp_path):
    assert ElfSymbols("/bin/true").address_of("_PyRuntime") is None
    bad = tmp_path / "not-elf"
    bad.write_bytes(b"hello")
    assert ElfSymbols(str(bad)).address_of("_PyRuntime") is None


def _readelf_objects(path: str) -> dict[str, int]:
    """Name -> value of each defined data object (or TLS) in the file's .symtab, for
    names held by one address only (static objects of several files share names)."""
    out = subprocess.run(["readelf", "-sW", path], capture_output=True, text=True, check=True).stdout
    values = defaultdict(set)
    for row in out[out.index("'.symtab'"):].splitlines():
        f = row.split()
        if len(f) == 8 and f[3] in ("OBJECT", "TLS") and f[6] != "UND" and int(f[2], 0) > 0:
            values[f[7]].add(int(f[1], 16))
    return {name: v.pop() for name, v in values.items() if len(v) == 1}


@pytest.mark.parametrize("version", list(PYTHON_VERSIONS))
def test_address_of_every_object_as_readelf(version):
    """Every uniquely named data object of libpython, tail-merged names among them
    ("_PyRuntime" may be stored as the end of a longer name), is found at readelf's value."""
    python_interpreter(version)
    lib = PYENV / PYTHON_VERSIONS[version] / "lib" / f"libpython{version}.so.1.0"
    truth = _readelf_objects(str(lib))
    assert "_PyRuntime" in truth
    assert any(other != name and other.endswith(name) for name in truth for other in truth)
    elf = ElfSymbols(str(lib))
    assert {name: elf.address_of(name) for name in truth} == truth


@pytest.mark.kernel
@pytest.mark.parametrize("version", list(PYTHON_VERSIONS))
def test_thread_ids_of_another_pid_namespace_are_the_hosts(version):
    """A CPython in its own pid namespace (a container's) stores its threads' ids as it
    numbers them (1, 2, ...): attach maps them to the host's, the tids the kernel's
    probes see, and so does every later read of the thread list."""
    require_root("makes a pid namespace and reads another process's memory")
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", python_interpreter(version), "-c", WORKLOAD],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert outer.stdout.readline().strip() == "ready"
        pid = int(open(f"/proc/{outer.pid}/task/{outer.pid}/children").read().split()[0])
        deadline = time.monotonic() + 5
        while len(os.listdir(f"/proc/{pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        tasks = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        nspid = next(line for line in open(f"/proc/{pid}/status") if line.startswith("NSpid:")).split()[1:]
        assert len(nspid) == 2 and nspid[1] != str(pid), nspid  # its own pid namespace's number too
        py = pyruntime.attach(pid)
        assert set(py.threads) == tasks
        mem = pyruntime.ProcessMemory(pid)
        try:
            assert pyruntime.thread_states(mem, py.runtime, py.offsets) == py.threads
        finally:
            mem.close()
    finally:
        outer.kill()
        outer.wait()
