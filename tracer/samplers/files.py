"""Names for the inodes and devices the disk and writeback counts refer to: `file` rows
(the path a traced process had open or mapped, by whole disk and inode) and
`block_device` rows ("254:0" -> "vda").

The kernel counts by (device, inode), and a path is known only while a traced process
holds the file: whenever a flush's rows bring (device, inode) keys not yet named, the
traced processes' open descriptors (/proc/PID/fd) are searched for them, and at the stop
their descriptors and mappings (/proc/PID/maps) for those still unnamed.  A file closed
before any search stays unnamed (the analysis then says "inode N on vda")."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.trace.spool import make_batch
from trainbpf.tracer.disks import device_name, file_disk
from trainbpf.tracer.source import Source
from trainbpf.tracer.symbols.maps import ProcMaps

# Kinds whose rows name an inode (storage columns: name = device, addr = inode) and those
# that name a device (in `name`).  Of the inodes, those searched for: the ones a traced
# process may hold open (it wrote or dirtied them; the page cache's rows, opt-in, carry
# no process), not every inode the machine's flushers write back or its tasks dirty.
DEVICE_KINDS = ("disk_io", "writeback_inode", "dirtied", "write_path", "page_cache")
SEARCHED_KINDS = ("dirtied", "write_path", "page_cache")
# A search's bounds: descriptors read per process, and its time (~5 us a descriptor);
# what is left waits for the next search.  Inodes of any task show up at every flush of a
# busy machine, so a search may run at every flush: at most 2% of a CPU.
SCAN_FDS = 4096
SCAN_BUDGET_S = 0.02
# Inodes searched for and not found, remembered so as not to search for them again; past
# this many the oldest are forgotten (a long recording on a busy machine sees millions).
UNNAMED_KEPT = 65536

Key = tuple[str, int]  # (whole disk "MAJ:MIN", inode)


class FileNames(Source):
    """`file` rows for the inodes the flushes' rows count, `block_device` rows for their
    devices (the module's docstring says when and how)."""

    name = "files"

    def open(self, session) -> None:
        super().open(session)
        self.wanted = any(p.name in ("disk", "writeback") for p in session.probes)
        self.named: set[Key] = set()  # keys with a file row
        self.unnamed: dict[Key, None] = {}  # keys searched for and not found, oldest first
        self.devices: set[str] = set()  # devices with a block_device row, or without a name to give
        self.disks: dict[int, str] = {}  # st_dev -> its whole disk

    def describe(self, rows: pa.RecordBatch, maps: ProcMaps) -> tuple[pa.RecordBatch, list[pa.RecordBatch]]:
        if not self.wanted:
            return rows, []
        rows_named = _of_kinds(rows, DEVICE_KINDS)  # once: the rows searched are among them
        new = inode_keys(rows_named, self.session.threads.tgids()) - self.named - self.unnamed.keys()
        # Descriptors only while recording: a file is written through one; the mappings,
        # most of a search's cost, are read for what is still unnamed at the stop.
        batches = self.search(new | self.unnamed.keys(), None) if new else []
        return rows, batches + self.device_rows(row_devices(rows_named) | {device for device, _ in new})

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        if not (final and self.wanted and self.unnamed):
            return ended
        return ended + self.search(set(self.unnamed), ProcMaps())

    def meta(self) -> dict:
        return {"files": {"named": len(self.named), "unnamed": len(self.unnamed)}} if self.wanted else {}

    def search(self, wanted: set[Key], maps: ProcMaps | None) -> list[pa.RecordBatch]:
        """`file` rows of the wanted keys found in the traced processes' descriptors and
        (with `maps`) mappings; the rest are remembered as unnamed."""
        found = self.scan(self.session.threads.tgids(), wanted, maps)
        self.named |= found.keys()
        for key in wanted - found.keys():
            self.unnamed[key] = None
        for key in list(found) + list(self.unnamed)[:max(0, len(self.unnamed) - UNNAMED_KEPT)]:
            self.unnamed.pop(key, None)
        if not found:
            return []
        keys = list(found)
        return [make_batch("file", {
            "ts_ns": np.full(len(keys), time.monotonic_ns(), dtype=np.int64),
            "pid": np.array([found[k][0] for k in keys], dtype=np.int32),
            "device": [k[0] for k in keys],
            "inode": np.array([k[1] for k in keys], dtype=np.uint64),
            "path": [found[k][1] for k in keys],
        })]

    def scan(self, tgids: list[int], wanted: set[Key], maps: ProcMaps | None) -> dict[Key, tuple[int, str]]:
        """(pid, path) of each wanted key among the processes' open files and (with
        `maps`) mappings, within SCAN_FDS descriptors a process and SCAN_BUDGET_S in all."""
        deadline = time.monotonic() + SCAN_BUDGET_S
        found: dict[Key, tuple[int, str]] = {}
        for pid in tgids:
            if len(found) == len(wanted) or time.monotonic() > deadline:
                break
            mapped = self._mapped_files(pid, maps) if maps is not None else []
            for key, path in self._open_files(pid, deadline) + mapped:
                if key in wanted and key not in found:
                    found[key] = (pid, path)
        return found

    def _open_files(self, pid: int, deadline: float) -> list[tuple[Key, str]]:
        folder = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(folder)[:SCAN_FDS]
        except OSError:
            return []
        files = []
        for fd in fds:
            if time.monotonic() > deadline:
                break
            link = f"{folder}/{fd}"
            try:
                st = os.stat(link)  # the file the descriptor holds, whatever its name now
                files.append(((self._disk(st.st_dev), st.st_ino), os.readlink(link)))
            except OSError:
                continue
        return files

    def _mapped_files(self, pid: int, maps: ProcMaps) -> list[tuple[Key, str]]:
        index = maps.of(pid)
        if index is None:
            return []
        files = []
        for m in index.maps:
            if m.path and m.file[1]:
                major, minor = (int(x, 16) for x in m.file[0].split(":"))
                files.append(((self._disk(os.makedev(major, minor)), m.file[1]), m.path))
        return files

    def _disk(self, st_dev: int) -> str:
        if st_dev not in self.disks:
            self.disks[st_dev] = file_disk(st_dev)
        return self.disks[st_dev]

    def device_rows(self, devices: set[str]) -> list[pa.RecordBatch]:
        """`block_device` rows of the devices not yet given one."""
        new = sorted(devices - self.devices)
        self.devices |= set(new)
        named = [(d, n) for d in new if (n := device_name(d)) is not None]
        if not named:
            return []
        return [make_batch("block_device", {
            "ts_ns": np.full(len(named), time.monotonic_ns(), dtype=np.int64),
            "device": [d for d, _ in named],
            "name": [n for _, n in named],
        })]


def _of_kinds(rows: pa.RecordBatch, kinds: tuple[str, ...]) -> pa.RecordBatch:
    return rows.filter(pc.is_in(rows.column("kind"), value_set=pa.array(kinds)))


def inode_keys(rows: pa.RecordBatch, traced: list[int]) -> set[Key]:
    """The (device, inode) keys of a flush's rows worth a search: those the processes
    `traced` wrote or dirtied, and the page cache's."""
    named = _of_kinds(rows, SEARCHED_KINDS)
    theirs = pc.or_(pc.is_null(named.column("pid")), pc.is_in(named.column("pid"), value_set=pa.array(traced, pa.int32())))
    named = named.filter(pc.fill_null(theirs, True))
    return set(zip(named.column("name").to_pylist(), named.column("addr").to_pylist()))


def row_devices(rows: pa.RecordBatch) -> set[str]:
    """The devices a flush's rows name, each once (a thousand rows name a few)."""
    return set(pc.unique(_of_kinds(rows, DEVICE_KINDS).column("name")).to_pylist()) - {None}
