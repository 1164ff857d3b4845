"""Describing futex addresses from a live process's maps and ELF symbols (no BPF: the
describer reads /proc, so this process describes its own addresses)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from kernel_env import missing
from trainbpf.tracer.symbols.addrs import AddressDescriber
from trainbpf.tracer.symbols.elf import OBJECT_KINDS, symbol_tables
from trainbpf.tracer.symbols.maps import parse_maps


def describe(*addrs: int) -> list[tuple[str, str]]:
    batch = AddressDescriber().describe(np.array([(os.getpid(), a) for a in addrs], dtype=np.uint64).view(np.int64))
    rows = batch.to_pydict()
    assert rows["addr"] == list(addrs)
    return list(zip(rows["state"], [n or "" for n in rows["name"]]))


def test_the_interpreters_runtime_state_is_named():
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    assert describe(runtime + 0x1B0) == [("image", f"_PyRuntime+0x1b0 [{os.path.basename(os.path.realpath('/proc/self/exe'))}]")]


def test_a_librarys_data_symbol_is_named():
    libc = ctypes.CDLL("libc.so.6")
    stdout = ctypes.addressof(ctypes.c_void_p.in_dll(libc, "stdout"))
    ((state, name),) = describe(stdout)
    assert state == "image" and name.startswith("stdout+0x0 [libc.so")


def test_glibcs_malloc_arena_is_named_from_its_debug_file():
    """Debian's libc is stripped: main_arena, whose first word is the allocator's lock, is a
    local symbol of libc6-dbg's debug file (found by build-id), named only from there."""
    with open("/proc/self/maps") as fh:
        maps = parse_maps(fh.read())
    libc = next(m.path for m in maps if os.path.basename(m.path).startswith("libc.so"))
    tables = symbol_tables(libc, libc, OBJECT_KINDS)
    if len(tables) < 2:
        missing("libc's debug symbols are not installed (Debian package libc6-dbg; scripts/setup.sh installs it)")
    debug, own = tables
    linked = debug.address_of("main_arena")
    assert linked is not None and own.symbol(linked) is None, "the library itself does not name it"
    base = min(m.start - m.offset for m in maps if m.path == libc)
    assert describe(base + linked - own.first_vaddr) == [("image", f"main_arena+0x0 [{os.path.basename(libc)}]")]


def test_regions_outside_images():
    shared = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    private = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    described = describe(ctypes.addressof(ctypes.c_char.from_buffer(shared)),
                         ctypes.addressof(ctypes.c_char.from_buffer(private)), 12)
    assert [s for s, _ in described] == ["shared", "anon", "unknown"]


def test_each_address_is_described_once():
    d = AddressDescriber()
    pairs = np.array([(os.getpid(), 12), (os.getpid(), 16)], dtype=np.int64)
    assert d.describe(pairs).num_rows == 2
    assert d.describe(pairs) is None
    d.exec_seen()  # the process's addresses now mean other things
    assert d.describe(pairs).num_rows == 2


def test_a_gone_process_is_unknown():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    batch = AddressDescriber().describe(np.array([(pid, 0x1000)], dtype=np.int64))
    assert batch.to_pydict()["state"] == ["unknown"]


def test_parse_maps():
    maps = parse_maps("00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/dbus-daemon\n"
                      "7f0000000000-7f0000001000 rw-s 00000000 00:05 1 /dev/shm/sem.mp-x\n"
                      "7ffd0000-7ffe0000 rw-p 00000000 00:00 0                  [stack]\n")
    assert [(m.start, m.shared, m.path) for m in maps] == [
        (0x400000, False, "/usr/bin/dbus-daemon"), (0x7F0000000000, True, "/dev/shm/sem.mp-x"), (0x7FFD0000, False, "[stack]")]


def _cut_and_garbled(elf: bytes):
    """The file cut at every length up to its headers and at every 97th byte past them,
    and its header fields and section table overwritten with large values."""
    for n in [*range(0, 300), *range(300, len(elf), 97)]:
        yield elf[:n]
    shoff = int.from_bytes(elf[40:48], "little")
    for at in [*range(16, 64, 2), *range(shoff, min(len(elf), shoff + 64 * 40), 4)]:
        yield elf[:at] + b"\xff\xff\xff\x7f" + elf[at + 4:]


def test_a_truncated_or_malformed_elf_file_raises_elf_error_only(tmp_path):
    """Issue 34 item 6: a 4-byte file `\\x7fELF` named libpython3.11.so raised IndexError
    in the recorder.  Every ELF reader (data symbols, functions, CUDA exports) shares one
    parser: a file that does not hold what its headers say raises ElfError, nothing else."""
    from trainbpf.tracer.collectors.cuda import exported_calls
    from trainbpf.tracer.symbols.elf import FUNCTION_KINDS, ElfSymbols

    bad = tmp_path / "libpython3.11.so"
    bad.write_bytes(b"\x7fELF")
    with pytest.raises(ValueError, match="truncated or malformed ELF file"):
        ElfSymbols(str(bad))
    escaped = []
    for i, data in enumerate(_cut_and_garbled(open("/bin/true", "rb").read())):
        bad.write_bytes(data)
        for read in (lambda: ElfSymbols(str(bad)).address_of("_PyRuntime"),
                     lambda: ElfSymbols(str(bad), FUNCTION_KINDS, every_table=True).function(0x1100),
                     lambda: exported_calls(str(bad))):
            try:
                read()
            except ValueError:  # ElfError, or mmap's "cannot mmap an empty file"
                pass
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                escaped.append((i, len(data), type(exc).__name__, str(exc)[:60]))
    assert not escaped, escaped[:5]


def test_unique_rows_is_numpys_unique_of_rows():
    """futex_pairs' distinct (pid, address) rows by one sort, as np.unique(axis=0) gives
    them: addresses with the top bit set (int64 negative) included."""
    from trainbpf.tracer.symbols.addrs import unique_rows

    rng = np.random.default_rng(7)
    pairs = np.stack([rng.integers(1, 5, 400), rng.integers(-2**63, 2**63 - 1, 400, dtype=np.int64) % 9 - 4],
                     axis=1).astype(np.int64)
    pairs[:5, 1] = np.iinfo(np.int64).min
    assert np.array_equal(unique_rows(pairs), np.unique(pairs, axis=0))
    assert unique_rows(np.zeros((0, 2), np.int64)).shape == (0, 2)
