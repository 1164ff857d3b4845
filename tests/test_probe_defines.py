"""Constants the probes share with the collectors are declared once, in Python, and
reach the C as -D defines from the loader; each probe stops with #error without them."""

from __future__ import annotations

import re

from trainbpf.tracer import loader
from trainbpf.tracer.collector import PROBE_IDS
from trainbpf.tracer.settings import Settings

REQUIRED = re.compile(r'^#ifndef (\w+)\n#error "\1 must be defined by the loader"\n#endif$', re.M)


def _required(source: str) -> set[str]:
    return set(REQUIRED.findall((loader.probes_dir() / source).read_text()))


def _defined(collectors, tmp_path) -> dict[str, str]:
    flags = loader.cflags(collectors, Settings(), tmp_path)
    return dict(f[2:].partition("=")[::2] for f in flags if f.startswith("-D"))


def test_every_required_constant_is_passed_by_the_loader(tmp_path):
    for c in (c for c in loader.select(None, Settings()) if c.source):
        needed = _required("common.h") | _required(c.source)
        assert needed, f"{c.source} checks no constant"
        missing = needed - set(_defined(loader.select([c.name], Settings()), tmp_path))
        assert not missing, f"{c.source}: the loader does not pass {sorted(missing)}"


def test_shared_constants_are_not_defined_in_c(tmp_path):
    sources = [c.source for c in loader.select(None, Settings()) if c.source]
    required = set().union(*(_required(s) for s in sources)) | _required("common.h")
    text = "".join((loader.probes_dir() / src).read_text() for src in ["common.h"] + sources)
    assert not {name for name in required if re.search(rf"^#define {name}\b", text, re.M)}


def test_lost_counter_indexes_come_from_probe_ids(tmp_path):
    defined = _defined(loader.select(None, Settings()), tmp_path)
    assert {name: int(defined[f"PROBE_{name.upper()}"]) for name in PROBE_IDS} == PROBE_IDS
    assert int(defined["PROBE_COUNT"]) == len(PROBE_IDS)
