"""A stripped library's separate debug file found through its .gnu_debuglink name is used
only where its CRC32 is the one the link carries: the name alone (a container's library
beside a host debug file of another build, under the same name) is not enough.  Two small
libraries are built here with gcc and split with objcopy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kernel_env import which_or_fail
from trainbpf.tracer.symbols.elf import FUNCTION_KINDS, ElfSymbols, debug_file, symbol_tables

SOURCE = "static int counted;\nstatic int {name}(int x) {{ return x + counted++; }}\nint entry(int x) {{ return {name}(x); }}\n"


def _split_library(folder: Path, helper: str) -> Path:
    """libwork.so built from a source whose local function is called `helper`, stripped
    of it, with its debug file libwork.so.debug beside it, linked by .gnu_debuglink (no
    build id: only the link can find it)."""
    gcc, objcopy = which_or_fail("gcc", "gcc"), which_or_fail("objcopy", "binutils")
    folder.mkdir()
    (folder / "work.c").write_text(SOURCE.format(name=helper))
    lib = folder / "libwork.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-g", "-O0", "-Wl,--build-id=none", "-o", str(lib), str(folder / "work.c")],
                   check=True)
    subprocess.run([objcopy, "--only-keep-debug", str(lib), str(folder / "libwork.so.debug")], check=True)
    subprocess.run([objcopy, "--strip-all", f"--add-gnu-debuglink={folder / 'libwork.so.debug'}", str(lib)],
                   check=True, cwd=folder)
    return lib


def test_a_debug_file_found_by_its_link_is_used_only_with_the_links_crc(tmp_path):
    lib = _split_library(tmp_path / "container", "scale_batch")
    other = _split_library(tmp_path / "host", "shuffle_rows")
    own = ElfSymbols(str(lib), FUNCTION_KINDS)
    assert (own.debuglink, own.build_id) == ("libwork.so.debug", "")
    # its own debug file: found, and names the local function the library lost
    assert debug_file(str(lib), own) == str(lib.with_name("libwork.so.debug"))
    debug, _ = symbol_tables(str(lib), str(lib), FUNCTION_KINDS)
    assert debug.address_of("scale_batch") is not None
    # another build's debug file under the same name: refused
    shutil.copyfile(other.with_name("libwork.so.debug"), lib.with_name("libwork.so.debug"))
    assert debug_file(str(lib), own) is None, "a debug file of another build was taken by its name"
    assert [t.address_of("shuffle_rows") for t in symbol_tables(str(lib), str(lib), FUNCTION_KINDS)] == [None]

