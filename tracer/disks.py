"""Devices as the trace names them: the WHOLE disk "MAJ:MIN" a file system or partition
is on, what block tracepoints and the writeback tracepoints' bdi name say.  Shared by
the collectors whose rows name a device."""

from __future__ import annotations

import os
from pathlib import Path

from trainbpf.trace.schema import kernel_device

SYS_DEV_BLOCK = Path("/sys/dev/block")


def whole_disk(major: int, minor: int, sys_dev_block: Path = SYS_DEV_BLOCK) -> str:
    """The disk a block device is on, as "MAJ:MIN": a partition's parent disk (its
    /sys/dev/block entry has a `partition` file and sits in the disk's folder), else the
    device itself (a whole disk, or a file system without a block device, e.g. "0:45")."""
    entry = sys_dev_block / f"{major}:{minor}"
    try:
        if (entry / "partition").exists():
            return (entry.resolve().parent / "dev").read_text().strip()
    except OSError:
        pass
    return f"{major}:{minor}"


class KernelDisks:
    """Kernel dev_t values (what a tracepoint's dev or s_dev field holds) as their whole
    disks, each looked up in /sys once."""

    def __init__(self, sys_dev_block: Path = SYS_DEV_BLOCK) -> None:
        self.sys_dev_block = sys_dev_block
        self.disks: dict[int, str] = {}

    def name(self, dev: int) -> str:
        if dev not in self.disks:
            major, minor = (int(x) for x in kernel_device(dev).split(":"))
            self.disks[dev] = whole_disk(major, minor, self.sys_dev_block)
        return self.disks[dev]


def file_disk(st_dev: int, sys_dev_block: Path = SYS_DEV_BLOCK) -> str:
    """The whole disk of a stat() st_dev (a file's file system), as "MAJ:MIN"."""
    return whole_disk(os.major(st_dev), os.minor(st_dev), sys_dev_block)


def device_name(device: str, sys_dev_block: Path = SYS_DEV_BLOCK) -> str | None:
    """A block device's kernel name ("vda"), None when "MAJ:MIN" is no block device."""
    entry = sys_dev_block / device
    return entry.resolve().name if entry.is_symlink() else None
