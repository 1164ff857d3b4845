"""Offsets of kernel struct fields, read from the running kernel's BTF
(/sys/kernel/btf/vmlinux).

The probes are compiled against whatever headers are at hand, often older than the
running kernel, and a struct read through them lands on other fields (struct sock's
sk_socket sits at 624 in 6.1's headers, at 288 in 6.18).  Where a probe must follow a
kernel pointer (probes/net.bpf.c: a socket's peer, inode and route) it takes each offset
as a -D define from here instead."""

from __future__ import annotations

import functools
import struct
from pathlib import Path

BTF_VMLINUX = Path("/sys/kernel/btf/vmlinux")
BTF_MAGIC = 0xEB9F
ARRAY, STRUCT, UNION, TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG = 3, 4, 5, 8, 9, 10, 11, 18
QUALIFIERS = (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG)
# Bytes after the 12-byte common part of a type, by kind (vlen: its member count).
_FIXED_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}
_PER_MEMBER = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}


class KernelTypes:
    """The struct and union types of one BTF blob, looked up by name."""

    def __init__(self, blob: bytes):
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, _str_len = struct.unpack_from("<HBBIIIII", blob)
        if magic != BTF_MAGIC:
            raise ValueError("not BTF")
        self.blob = blob
        self.strings = hdr_len + str_off
        self.types: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)]  # id -> (kind, vlen, kflag, position)
        self.structs: dict[str, int] = {}  # name -> id of the first complete struct/union so named
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len
        while pos < end:
            name_off, info, _ = struct.unpack_from("<III", blob, pos)
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            self.types.append((kind, vlen, kflag, pos))
            if kind in (STRUCT, UNION) and vlen:
                self.structs.setdefault(self._name(name_off), len(self.types) - 1)
            pos += 12 + _FIXED_EXTRA.get(kind, 0) + _PER_MEMBER.get(kind, 0) * vlen

    def _name(self, off: int) -> str:
        start = self.strings + off
        return self.blob[start:self.blob.index(b"\0", start)].decode()

    def _resolve(self, type_id: int) -> int:
        """The type behind typedefs and qualifiers; an array's element type (a path
        into an array names its first element)."""
        while self.types[type_id][0] in QUALIFIERS + (ARRAY,):
            kind, _, _, pos = self.types[type_id]
            type_id = struct.unpack_from("<I", self.blob, pos + (12 if kind == ARRAY else 8))[0]
        return type_id

    def _member(self, type_id: int, name: str) -> tuple[int, int] | None:
        """(byte offset, type id) of member `name` of a struct or union, looking into its
        anonymous members."""
        kind, vlen, kflag, pos = self.types[self._resolve(type_id)]
        if kind not in (STRUCT, UNION):
            return None
        for i in range(vlen):
            name_off, member_type, offset = struct.unpack_from("<III", self.blob, pos + 12 + 12 * i)
            bits = offset & 0xFFFFFF if kflag else offset
            if name_off and self._name(name_off) == name:
                return bits // 8, member_type
            if not name_off:
                inner = self._member(member_type, name)
                if inner is not None:
                    return bits // 8 + inner[0], inner[1]
        return None

    def offset(self, struct_name: str, path: str) -> int | None:
        """Byte offset of `path` ("__sk_common.skc_daddr") in struct `struct_name`; None
        where the kernel has no such struct or field."""
        type_id = self.structs.get(struct_name)
        total = 0
        for part in path.split("."):
            found = None if type_id is None else self._member(type_id, part)
            if found is None:
                return None
            total, type_id = total + found[0], found[1]
        return total


@functools.lru_cache(maxsize=None)
def kernel_types(path: Path = BTF_VMLINUX) -> KernelTypes | None:
    """The running kernel's types; None where it has no BTF (or it cannot be read)."""
    try:
        return KernelTypes(path.read_bytes())
    except (OSError, ValueError, struct.error):
        return None


def field_offsets(fields: dict[str, tuple[str, str]], path: Path = BTF_VMLINUX) -> dict[str, int] | None:
    """Each name's (struct, field path) offset in the running kernel; None when the
    kernel has no BTF or lacks any of them."""
    types = kernel_types(path)
    if types is None:
        return None
    offsets = {name: types.offset(s, p) for name, (s, p) in fields.items()}
    return None if any(v is None for v in offsets.values()) else offsets  # type: ignore[return-value]
