"""CPython runtime discovery from user space, for the Python-frame walk (probes/pyframes.h).

Finds `_PyRuntime` through the ELF symbol table (tracer/symbols/addrs.py) of the python binary or libpython
mapped in /proc/PID/maps, reads the interpreter's layout (3.13+: `_Py_DebugOffsets`,
which CPython keeps at the start of `_PyRuntime` for exactly this), walks the thread
list (_PyRuntime -> interpreters.head -> threads.head -> next) into tid ->
PyThreadState address, and self-tests the offsets against the live process before
anything trusts them.  Everything is read through /proc/PID/mem; nothing here needs BPF.

3.10 to 3.12 have no debug offsets: their tables below were computed by compiling a
tiny C program (offsetof/sizeof, Py_BUILD_CORE) against each pyenv version's own
headers (include/python3.X/internal/*.h; 3.10.13, 3.11.7, 3.12.1).  3.10's thread state
has no native thread id, only pthread_self(): the tid is read from glibc's struct
pthread, at the one offset where every thread's value is a task of the process.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from trainbpf.tracer.symbols.elf import ElfError, ElfSymbols
from trainbpf.tracer.symbols.maps import open_mapped, parse_maps

DEBUG_COOKIE = b"xdebugpy"
# Field order of _Py_DebugOffsets in 3.13 (Include/internal/pycore_runtime.h), each a
# uint64 after cookie[8]; groups start with their struct's size.
_DEBUG_FIELDS = (
    "version", "free_threaded",
    "rt.size", "rt.finalizing", "rt.interpreters_head",
    "interp.size", "interp.id", "interp.next", "interp.threads_head", "interp.gc",
    "interp.imports_modules", "interp.sysdict", "interp.builtins", "interp.ceval_gil",
    "interp.gil_runtime_state", "interp.gil_runtime_state_enabled",
    "interp.gil_runtime_state_locked", "interp.gil_runtime_state_holder",
    "ts.size", "ts.prev", "ts.next", "ts.interp", "ts.current_frame", "ts.thread_id",
    "ts.native_thread_id", "ts.datastack_chunk", "ts.status",
    "frame.size", "frame.previous", "frame.executable", "frame.instr_ptr",
    "frame.localsplus", "frame.owner",
    "code.size", "code.filename", "code.name", "code.qualname", "code.linetable",
    "code.firstlineno", "code.argcount", "code.localsplusnames", "code.localspluskinds",
    "code.co_code_adaptive",
    "obj.size", "obj.ob_type",
    "type.size", "type.tp_name", "type.tp_repr", "type.tp_flags",
    "tuple.size", "tuple.ob_item", "tuple.ob_size",
    "list.size", "list.ob_item", "list.ob_size",
    "dict.size", "dict.ma_keys", "dict.ma_values",
    "float.size", "float.ob_fval",
    "long.size", "long.lv_tag", "long.ob_digit",
    "bytes.size", "bytes.ob_size", "bytes.ob_sval",
    "unicode.size", "unicode.state", "unicode.length", "unicode.asciiobject_size",
)
# Keys as in _DEBUG_FIELDS; "ts.cframe" + "cframe.current_frame" stand for 3.13's
# "ts.current_frame" (3.11/3.12 reach the frame through tstate->cframe).
# Fields at the same offset in 3.11 and 3.12; each version's dict adds what moved.
_TABLE_COMMON = {
    "rt.interpreters_head": 40, "interp.next": 0, "ts.next": 8, "ts.cframe": 56,
    "frame.instr_ptr": 56, "code.filename": 112, "code.name": 120, "code.qualname": 128,
    "code.linetable": 136, "obj.ob_type": 8, "type.tp_name": 24, "unicode.length": 16,
    "unicode.state": 32, "bytes.ob_size": 16, "bytes.ob_sval": 32,
}
_TABLES = {
    # 3.10: frames are PyFrameObjects (tstate->frame, f_back, f_code, f_lasti: an int
    # counting code units); no co_qualname; "ts.thread_id" is pthread_self().
    "3.10": {
        "rt.interpreters_head": 32, "interp.next": 0, "interp.threads_head": 8, "ts.next": 8,
        "ts.current_frame": 24, "ts.thread_id": 176, "frame.previous": 24,
        "frame.executable": 32, "frame.instr_ptr": 96, "code.filename": 104, "code.name": 112,
        "code.firstlineno": 40, "code.linetable": 120, "obj.ob_type": 8, "type.tp_name": 24,
        "unicode.length": 16, "unicode.state": 32, "unicode.asciiobject_size": 48,
        "bytes.ob_size": 16, "bytes.ob_sval": 32,
    },
    "3.11": _TABLE_COMMON | {
        "interp.threads_head": 16, "ts.native_thread_id": 160, "cframe.current_frame": 8,
        "frame.previous": 48, "frame.executable": 32, "code.firstlineno": 72,
        "code.co_code_adaptive": 184, "unicode.asciiobject_size": 48,
    },
    "3.12": _TABLE_COMMON | {
        "interp.threads_head": 72, "ts.native_thread_id": 144, "cframe.current_frame": 0,
        "frame.previous": 8, "frame.executable": 0, "frame.owner": 70,
        "code.firstlineno": 68, "code.co_code_adaptive": 192,
        "unicode.asciiobject_size": 40,
    },
}
_PYTHON_MAP = re.compile(r"/(?:lib)?python(3\.\d+)[^/]*$")
MAX_THREADS = 4096  # a cycle in a corrupt thread list must not spin forever
MAX_FRAMES = 16  # the walk's own limit, per thread
FRAME_OWNED_BY_CSTACK = 3  # 3.12 and 3.13 Include/internal/pycore_frame.h
PTHREAD_SCAN_BYTES = 2048  # where in glibc's struct pthread its tid is looked for (3.10)


class PyRuntimeError(Exception):
    """The process is not a CPython we can read; str() is the one-line status, `version`
    the CPython version ("3.12") when the process is one."""

    def __init__(self, message: str, version: str | None = None):
        super().__init__(message)
        self.version = version


@dataclass
class ProcessMemory:
    pid: int
    _fd: int = field(init=False, default=-1)

    def __post_init__(self):
        self._fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)

    def read(self, addr: int, size: int) -> bytes:
        if not 0 < addr < 1 << 47:  # x86-64 user space; a garbage pointer reads nothing
            raise PyRuntimeError(f"pointer {addr:#x} is outside user space")
        try:
            data = os.pread(self._fd, size, addr)
        except OSError as err:
            raise PyRuntimeError(f"cannot read {size} bytes at {addr:#x}: {err.strerror}") from None
        if len(data) != size:
            raise PyRuntimeError(f"short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def find_runtime(pid: int) -> tuple[str, int]:
    """(version "3.X", address of _PyRuntime) in process `pid`.  The files are read as
    mapped (addrs.open_mapped), and a malformed one is passed over: the process chose it."""
    malformed = None
    for m in parse_maps(Path(f"/proc/{pid}/maps").read_text()):
        found = _PYTHON_MAP.search(m.path)
        if m.offset != 0 or not found:
            continue
        try:
            fd = open_mapped(pid, m)
        except OSError:
            continue
        try:
            elf = ElfSymbols(f"/proc/self/fd/{fd}")
        except ElfError as err:
            malformed = PyRuntimeError(f"{m.path}: {err}", found.group(1))
            continue
        except (OSError, ValueError):  # not mappable (empty), unreadable
            continue
        finally:
            os.close(fd)
        value = elf.address_of("_PyRuntime")
        if value is not None:
            mapped_at = elf.file_vaddr(0)
            return found.group(1), m.start + value - (elf.first_vaddr if mapped_at is None else mapped_at)
    raise malformed or PyRuntimeError("no _PyRuntime symbol in any mapped python binary or libpython")


def read_debug_offsets(mem: ProcessMemory, runtime: int) -> dict[str, int]:
    raw = mem.read(runtime, 8 + 8 * len(_DEBUG_FIELDS))
    if raw[:8] != DEBUG_COOKIE:
        raise PyRuntimeError("_PyRuntime does not start with the _Py_DebugOffsets cookie")
    values = struct.unpack_from(f"<{len(_DEBUG_FIELDS)}Q", raw, 8)
    return dict(zip(_DEBUG_FIELDS, values))


def own_tids(pid: int) -> dict[int, int]:
    """Process `pid`'s threads: tid as the process itself sees it (its pid namespace's,
    which CPython stores) -> tid as the recorder and the kernel's probes see it.  The
    same numbers unless the process is in another pid namespace (a container): then the
    last field of each thread's NSpid line."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        if os.stat(f"/proc/{pid}/ns/pid").st_ino == os.stat("/proc/self/ns/pid").st_ino:
            return {tid: tid for tid in tids}
    except OSError as err:
        raise PyRuntimeError(f"process {pid}: {err.strerror}") from None
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as fh:
                nspid = next((line for line in fh if line.startswith(b"NSpid:")), b"")
        except OSError:  # exited meanwhile
            continue
        if nspid.split()[1:]:
            out[int(nspid.split()[-1])] = tid
    return out


def _own_pid(pid: int, tids: dict[int, int]) -> int:
    """`pid` as the process sees itself (own_tids' keys)."""
    return next((own for own, host in tids.items() if host == pid), pid)


@dataclass
class PyProcess:
    """A CPython process whose layout passed the self-test."""

    pid: int
    version: str
    runtime: int
    offsets: dict[str, int]
    threads: dict[int, int]  # native tid -> PyThreadState address


def thread_list(mem: ProcessMemory, runtime: int, off: dict[str, int]) -> list[int]:
    """Every PyThreadState address of every interpreter, in list order."""
    out: list[int] = []
    seen: set[int] = set()  # a wrong `next` offset can make a cycle: refuse it
    interp = mem.u64(runtime + off["rt.interpreters_head"])
    while interp:
        ts = mem.u64(interp + off["interp.threads_head"])
        while ts:
            if ts in seen or len(seen) >= MAX_THREADS:
                raise PyRuntimeError("the interpreter's thread list loops or is too long")
            seen.add(ts)
            out.append(ts)
            ts = mem.u64(ts + off["ts.next"])
        if interp in seen:
            raise PyRuntimeError("the interpreter list loops")
        seen.add(interp)
        interp = mem.u64(interp + off["interp.next"])
    return out


def thread_states(mem: ProcessMemory, runtime: int, off: dict[str, int]) -> dict[int, int]:
    """Native tid as the recorder sees it (own_tids) -> PyThreadState address; threads
    gone meanwhile left out."""
    host = own_tids(mem.pid)
    return {host[tid]: ts for tid, ts in own_thread_states(mem, runtime, off).items() if tid in host}


def own_thread_states(mem: ProcessMemory, runtime: int, off: dict[str, int]) -> dict[int, int]:
    """Native tid as the process sees it (its pid namespace's) -> PyThreadState address."""
    out: dict[int, int] = {}
    for ts in thread_list(mem, runtime, off):
        if "ts.native_thread_id" not in off:  # 3.10: through pthread_self()
            tid = struct.unpack("<I", mem.read(mem.u64(ts + off["ts.thread_id"]) + off["pthread.tid"], 4))[0]
        else:
            tid = struct.unpack("<q", mem.read(ts + off["ts.native_thread_id"], 8))[0]
        out[tid] = ts
    return out


def pthread_tid_offset(mem: ProcessMemory, pid: int, runtime: int, off: dict[str, int]) -> int:
    """Where glibc's struct pthread keeps the kernel tid: the one 4-byte offset at which
    every listed thread's value is a distinct task of `pid`, one of them `pid` itself
    (numbered as in the process's own pid namespace)."""
    pthreads = [mem.read(mem.u64(ts + off["ts.thread_id"]), PTHREAD_SCAN_BYTES)
                for ts in thread_list(mem, runtime, off)]
    own = own_tids(pid)
    tasks, pid = set(own), _own_pid(pid, own)
    found = []
    for at in range(0, PTHREAD_SCAN_BYTES, 4):
        tids = [struct.unpack_from("<I", raw, at)[0] for raw in pthreads]
        if pid in tids and len(set(tids)) == len(tids) and set(tids) <= tasks:
            found.append(at)
    if len(found) != 1:
        raise PyRuntimeError(f"no single place for the tid in glibc's struct pthread ({len(found)} candidates)")
    return found[0]


def read_ascii(mem: ProcessMemory, obj: int, off: dict[str, int]) -> str:
    """A compact str object's text; the frame names we need are compact ASCII or
    latin-1/UCS from the compiler, and anything else fails the decode (never guessed)."""
    length = mem.u64(obj + off["unicode.length"])
    state = struct.unpack("<I", mem.read(obj + off["unicode.state"], 4))[0]
    kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
    if not compact or not ascii_ or kind != 1 or length > 4096:
        raise PyRuntimeError("code object name is not a compact ASCII str")
    return mem.read(obj + off["unicode.asciiobject_size"], length).decode("utf-8")


def type_name(mem: ProcessMemory, obj: int, off: dict[str, int]) -> str:
    tp = mem.u64(obj + off["obj.ob_type"])
    name_ptr = mem.u64(tp + off["type.tp_name"])
    raw = mem.read(name_ptr, 32)
    return raw.split(b"\0", 1)[0].decode("utf-8", "strict")


def current_frame(mem: ProcessMemory, ts: int, off: dict[str, int]) -> int:
    if "ts.cframe" in off:
        cframe = mem.u64(ts + off["ts.cframe"])
        return mem.u64(cframe + off["cframe.current_frame"]) if cframe else 0
    return mem.u64(ts + off["ts.current_frame"])


def _check_code(mem: ProcessMemory, code: int, off: dict[str, int]) -> None:
    if type_name(mem, code, off) != "code":
        raise PyRuntimeError("self-test: a frame's executable is not a code object")
    name = read_ascii(mem, mem.u64(code + off["code.name"]), off)
    filename = read_ascii(mem, mem.u64(code + off["code.filename"]), off)
    if "code.qualname" not in off:  # 3.10
        if filename == name:
            raise PyRuntimeError("self-test: a code object's name fields do not agree")
        return
    qualname = read_ascii(mem, mem.u64(code + off["code.qualname"]), off)
    # The name fields sit side by side: a skew onto a neighbour still reads a str, so
    # check how they relate (a qualname's last part is the name; a file is neither).
    # A module frame (name == qualname) cannot tell co_name from co_qualname; a method
    # or nested function anywhere in the process does.
    if qualname.rsplit(".", 1)[-1] != name or filename in (name, qualname):
        raise PyRuntimeError("self-test: a code object's name fields do not agree")


def python_frames(mem: ProcessMemory, ts: int, off: dict[str, int]) -> list[tuple[int, int]]:
    """A thread's (code object, raw instruction word) per Python frame, innermost first:
    the walk probes/pyframes.h makes in the kernel, from user space."""
    out = []
    frame = current_frame(mem, ts, off)
    steps = 0
    while frame and len(out) < MAX_FRAMES and steps < 2 * MAX_FRAMES:
        steps += 1
        # 3.10 and 3.11 have no owner field: every frame on their chain is a Python frame.
        owner = mem.read(frame + off["frame.owner"], 1)[0] if "frame.owner" in off else 0
        if owner != FRAME_OWNED_BY_CSTACK:
            instr = mem.u64(frame + off["frame.instr_ptr"])
            out.append((mem.u64(frame + off["frame.executable"]), instr))
        frame = mem.u64(frame + off["frame.previous"])
    return out


def self_test(mem: ProcessMemory, pid: int, runtime: int, off: dict[str, int],
              threads: dict[int, int]) -> None:
    """Raise PyRuntimeError unless the layout reads true in this process: every thread
    id found is a task of the process, the main thread is among them, and every frame
    of every thread (up to MAX_FRAMES each) holds a `code` object whose name fields
    decode and agree.  `threads` as own_thread_states gives them."""
    own = own_tids(pid)
    tasks, pid = set(own), _own_pid(pid, own)
    if not threads:
        raise PyRuntimeError("self-test: the interpreter's thread list is empty")
    stray = set(threads) - tasks
    if stray:
        raise PyRuntimeError(f"self-test: thread ids {sorted(stray)[:3]} are not tasks of {pid}")
    if pid not in threads:
        raise PyRuntimeError("self-test: the main thread is not in the thread list")
    checked = 0
    for ts in threads.values():
        for code, _ in python_frames(mem, ts, off):
            _check_code(mem, code, off)
            checked += 1
    if checked:
        return
    raise PyRuntimeError("self-test: no thread has a current frame")


def attach(pid: int, corrupt: str | None = None) -> PyProcess:
    """Discover and self-test CPython in `pid`.  `corrupt` names one offset to skew by
    8 bytes, for testing that the self-test refuses a wrong table."""
    version, runtime = find_runtime(pid)
    major, minor = map(int, version.split("."))
    if (major, minor) < (3, 10) or ((major, minor) < (3, 13) and version not in _TABLES):
        raise PyRuntimeError(f"CPython {version}: no offset table for this version yet", version)
    mem = ProcessMemory(pid)
    try:
        if version in _TABLES:
            off = dict(_TABLES[version])
        else:
            off = read_debug_offsets(mem, runtime)
            if off["free_threaded"]:
                raise PyRuntimeError("free-threaded builds are not supported")
        if corrupt:
            off[corrupt] += 8
        if "ts.native_thread_id" not in off:
            off["pthread.tid"] = pthread_tid_offset(mem, pid, runtime, off)
        threads = own_thread_states(mem, runtime, off)
        self_test(mem, pid, runtime, off, threads)
        host = own_tids(pid)
    except PyRuntimeError as err:
        raise PyRuntimeError(f"CPython {version}: {err}", version) from None
    finally:
        mem.close()
    return PyProcess(pid, version, runtime, off, {host[tid]: ts for tid, ts in threads.items() if tid in host})
