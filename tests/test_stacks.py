"""Naming user stack frames (no BPF: a stand-in for bcc's stack table and symbol lookup,
counting lookups; the maps read are this process's and a forked child's, for real)."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time

import numpy as np

from trainbpf.tracer.stacks import StackSymbolizer


class FakeStackTable:
    class Key(int):
        pass

    class Leaf:
        def __init__(self, ips):
            self.ip = (ctypes.c_uint64 * 32)(*ips)

    def __init__(self, stacks: dict[int, list[int]]):
        self.stacks = stacks

    def __getitem__(self, key):
        if int(key) not in self.stacks:
            raise KeyError(key)
        return self.Leaf(self.stacks[int(key)])


class FakeBpf:
    """bcc's BPF as StackSymbolizer uses it: the stack table and user symbol lookups."""

    def __init__(self, stacks):
        self.table = FakeStackTable(stacks)
        self.lookups: list[tuple[int, int]] = []

    def __getitem__(self, name):
        assert name == "stacks"
        return self.table

    def sym(self, addr, pid, show_module=False):
        self.lookups.append((addr, pid))
        return f"f_{addr:x} [lib]".encode()


def forked_child() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    return pid


def names(batch):
    rows = batch.to_pydict()
    return dict(zip(zip(rows["kstack_id"], rows["pid"]), rows["name"]))


def test_a_forked_process_reuses_its_parents_names():
    """The same code in a forked worker is named without a lookup of its own; anonymous
    code (a JIT's) is looked up per process; an address in no executable mapping (a
    frame-pointer walk gone astray into data) is not looked up at all."""
    code = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value  # libc's text
    data = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    stray = ctypes.addressof(ctypes.c_char.from_buffer(data))
    jit_area = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    jit = ctypes.addressof(ctypes.c_char.from_buffer(jit_area))
    child = forked_child()
    try:
        bpf = FakeBpf({1: [code, jit, stray], 2: [code + 16]})
        sym = StackSymbolizer(bpf)
        first = names(sym.symbolize([], np.array([(1, os.getpid())])))
        later = names(sym.symbolize([], np.array([(1, child), (2, child)])))
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert first[(1, os.getpid())] == later[(1, child)] == f"f_{code:x} [lib];f_{jit:x} [lib];0x{stray:x}"
    assert later[(2, child)] == f"f_{code + 16:x} [lib]"
    assert sorted(bpf.lookups) == sorted([(code, os.getpid()), (jit, os.getpid()), (jit, child), (code + 16, child)])


def test_a_stack_ends_at_its_first_zero_or_after_32_frames():
    full = list(range(0x10000, 0x10000 + 32))
    bpf = FakeBpf({1: [0x20000, 0x20010], 2: full})
    got = names(StackSymbolizer(bpf).symbolize([], np.array([(1, os.getpid()), (2, os.getpid())])))
    assert got[(1, os.getpid())].count(";") == 1
    assert got[(2, os.getpid())].count(";") == 31
