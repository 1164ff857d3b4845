"""Constants the probes share with the collectors are declared once, in Python, and
reach the C as -D defines from the loader; each probe stops with #error without them."""

from __future__ import annotations

import re
import subprocess

from kernel_env import which_or_fail
from trainbpf.tracer import loader
from trainbpf.tracer.collector import PROBE_IDS
from trainbpf.tracer.collectors import cuda as cuda_calls, nccl as nccl_calls
from trainbpf.tracer.settings import Settings

REQUIRED = re.compile(r'^#ifndef (\w+)\n#error "\1 must be defined by the loader"\n#endif$', re.M)


def _required(source: str) -> set[str]:
    return set(REQUIRED.findall((loader.probes_dir() / source).read_text()))


# A tracefs format file as this kernel (6.18) writes it, of the event whose fields a
# probe reads at offsets (Collector.fields_at).
DIRTY_FOLIO_FORMAT = """name: writeback_dirty_folio
ID: 1009
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char name[32];\toffset:8;\tsize:32;\tsigned:0;
\tfield:ino_t ino;\toffset:40;\tsize:8;\tsigned:0;
\tfield:unsigned long index;\toffset:48;\tsize:8;\tsigned:0;

print fmt: "bdi %s: ino=%lu index=%lu", REC->name, (unsigned long)REC->ino, REC->index
"""


def _tracefs(root):
    """A tracefs with no optional tracepoint, and the format files fields_at reads."""
    folder = root / "events" / "writeback" / "writeback_dirty_folio"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "format").write_text(DIRTY_FOLIO_FORMAT)
    return root


def test_fields_read_at_offsets_take_them_from_the_format_file(tmp_path):
    from trainbpf.trace.errors import EnvironmentCheckError

    root = _tracefs(tmp_path)
    assert loader.field_offsets("writeback:writeback_dirty_folio", ("name", "ino"), root) == {
        "WRITEBACK_DIRTY_FOLIO_NAME_AT": 8, "WRITEBACK_DIRTY_FOLIO_INO_AT": 40}
    for tp, fields, words in (("writeback:writeback_dirty_folio", ("name", "folio_size"), "lacks field(s) folio_size"),
                              ("writeback:nosuch", ("ino",), "kernel lacks tracepoint writeback:nosuch")):
        try:
            loader.field_offsets(tp, fields, root)
        except EnvironmentCheckError as exc:
            assert words in str(exc)
        else:
            raise AssertionError(f"{tp} {fields} read")


def _defined(collectors, tmp_path) -> dict[str, str]:
    flags = loader.cflags(collectors, Settings(), _tracefs(tmp_path))
    return dict(f[2:].partition("=")[::2] for f in flags if f.startswith("-D"))


def test_every_required_constant_is_passed_by_the_loader(tmp_path):
    for c in (c for c in loader.select(list(loader.PROBE_NAMES), Settings()) if c.source):
        needed = _required("common.h") | _required("pyframes.h") | _required(c.source)
        assert needed, f"{c.source} checks no constant"
        missing = needed - set(_defined(loader.select([c.name], Settings()), tmp_path))
        assert not missing, f"{c.source}: the loader does not pass {sorted(missing)}"


def test_shared_constants_are_not_defined_in_c(tmp_path):
    sources = [c.source for c in loader.select(list(loader.PROBE_NAMES), Settings()) if c.source]
    required = set().union(*(_required(s) for s in sources)) | _required("common.h")
    text = "".join((loader.probes_dir() / src).read_text() for src in ["common.h"] + sources)
    assert not {name for name in required if re.search(rf"^#define {name}\b", text, re.M)}


def test_lost_counter_indexes_come_from_probe_ids(tmp_path):
    defined = _defined(loader.select(list(loader.PROBE_NAMES), Settings()), tmp_path)
    assert {name: int(defined[f"PROBE_{name.upper()}"]) for name in PROBE_IDS} == PROBE_IDS
    assert int(defined["PROBE_COUNT"]) == len(PROBE_IDS)


# `#ifndef X` then `#define X value`: a C fallback.  An include guard defines X bare.
C_DEFAULT = re.compile(r"^\s*#ifndef (\w+)\s*\n\s*#define \1[ \t]+\S", re.M)


def test_probes_have_no_c_defaults():
    """Every setting and size reaches the probes from Python: an #ifndef in a probe is the
    #error rule or an include guard, never a fallback value."""
    sources = sorted(p for p in loader.probes_dir().iterdir() if p.suffix in (".c", ".h"))
    assert sources
    defaults = {p.name: C_DEFAULT.findall(p.read_text()) for p in sources}
    assert not {name: found for name, found in defaults.items() if found}, "C fallbacks, declare them in Python"


def test_settings_reach_the_probes_as_defines(tmp_path):
    """Each setting the probes take is declared once, in Settings, required by a probe
    (#error rule), and passed with the value the recording was given."""
    from trainbpf.tracer.settings import Settings as Declared

    sources = [c.source for c in loader.select(list(loader.PROBE_NAMES), Settings()) if c.source]
    required = set().union(*(_required(s) for s in sources + ["common.h", "pyframes.h"]))
    given = Declared(min_block_ns=123, min_cuda_ns=456, cuda_bucket_ns=7_000_000, cuda_thread_records=64,
                     disk_bucket_ns=50_000_000, net_bucket_ns=20_000_000, refault_keys=4096, ringbuf_pages=8,
                     stack_frames=20, stack_entries=1000, trace_all=True, exec_leaves=True)
    assert set(given.defines()) <= required, "a setting no probe requires"
    flags = loader.cflags(loader.select(list(loader.PROBE_NAMES), given), given, _tracefs(tmp_path))
    defined = dict(f[2:].partition("=")[::2] for f in flags if f.startswith("-D"))
    assert {name: int(defined[name]) for name in given.defines()} == {
        "MIN_BLOCK_NS": 123, "MIN_FUTEX_NS": 20_000, "MIN_LOCK_NS": 10_000, "MIN_CUDA_NS": 456,
        "CUDA_BUCKET_NS": 7_000_000, "CUDA_THREAD_RECORDS": 64, "REFAULT_KEYS": 4096, "DISK_BUCKET_NS": 50_000_000,
        "NET_BUCKET_NS": 20_000_000,
        "RINGBUF_PAGES": 8, "STACK_FRAMES": 20, "STACK_ENTRIES": 1000, "TRACE_ALL": 1, "PYTHON_FRAMES": 1, "EXEC_LEAVES": 1}
    assert len(flags) == len(set(flags)), "a define passed twice"


def test_thresholds_are_every_declared_number():
    """The trace's `thresholds` metadata is derived from the declaration (a new setting is
    one line), and keeps the keys traces carry."""
    from dataclasses import fields

    from trainbpf.tracer.settings import Settings as Declared

    numbers = [f.name for f in fields(Declared) if f.metadata.get("threshold")]
    assert list(Declared().thresholds()) == numbers == [
        "min_block_ns", "min_futex_ns", "min_lock_ns", "oncpu_hz", "fault_bucket_ns", "min_cuda_ns",
        "cuda_bucket_ns", "cuda_thread_records", "refault_keys", "cgroup_sample_ns", "disk_bucket_ns",
        "net_bucket_ns", "ringbuf_pages", "stack_frames", "stack_entries", "hz"]
    assert Declared(min_lock_ns=5).thresholds()["min_lock_ns"] == 5


def _compiled_calls(collector, tmp_path) -> list[tuple[str, ...]]:
    """Each entry program of the collector's probe as the C preprocessor expands its call
    table define with the loader's defines: (symbol, every number it passes, in order)."""
    gcc = which_or_fail("gcc", "gcc")
    flags = loader.cflags([collector], Settings(), tmp_path)
    text = (loader.probes_dir() / collector.source).read_text()
    done = subprocess.run([gcc, "-E", "-P", "-x", "c", *flags, "-"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expanded = " ".join(done.stdout.split())
    entries = re.findall(r"int enter_(\w+)\(struct pt_regs \*ctx\) \{ return \w+\(([^;]*)\); \}", expanded)
    assert len(re.findall(r"int return_\w+\(", expanded)) >= len(entries) > 0
    return [(name, *map(int, re.findall(r"\d+", passed))) for name, passed in entries]


def test_uprobe_programs_are_the_python_call_tables(tmp_path):
    """The probes' entry programs are CALLS row for row: symbol, call code, (for CUDA)
    layer and kind, and the argument numbers read (uprobe_arg)."""
    cuda = [(c.name, code, c.layer, c.kind, c.arg, c.bytes, c.stream, c.src) for code, c in enumerate(cuda_calls.CALLS)]
    assert _compiled_calls(cuda_calls.CudaCollector(Settings()), tmp_path) == cuda
    nccl = [(c.name, code, c.comm, c.elements) for code, c in enumerate(nccl_calls.CALLS)]
    assert _compiled_calls(nccl_calls.NcclCollector(Settings()), tmp_path) == nccl
