"""io_uring without liburing, for the workloads: one write through a ring of one entry,
by the raw syscalls (x86-64 numbers) and the ring layout of include/uapi/linux/io_uring.h."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

libc = ctypes.CDLL(None, use_errno=True)
SYS_IO_URING_SETUP, SYS_IO_URING_ENTER = 425, 426
IORING_OP_WRITE = 23
IORING_OFF_SQES = 0x10000000  # the submission entries' mmap offset
IORING_ENTER_GETEVENTS = 1
PARAMS_BYTES = 120  # struct io_uring_params
SQ_OFFSETS, CQ_OFFSETS = 40, 80  # its sq_off and cq_off
SQE = struct.Struct("BBHiQQIIQ")  # opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data
CQE = struct.Struct("Qi")  # user_data, res
U32 = struct.Struct("I")


def io_uring_write(fd: int, data: bytes, offset: int) -> int:
    """One IORING_OP_WRITE of `data` at `offset` of `fd`, waited for: its result (bytes
    written, or -errno)."""
    params = ctypes.create_string_buffer(PARAMS_BYTES)
    ring = libc.syscall(SYS_IO_URING_SETUP, 1, params)
    if ring < 0:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
    try:
        sq_entries, cq_entries = struct.unpack_from("II", params, 0)
        _, sq_tail, sq_mask, _, _, _, sq_array = struct.unpack_from("7I", params, SQ_OFFSETS)
        cq_head, _, cq_mask, _, _, cqes = struct.unpack_from("6I", params, CQ_OFFSETS)
        shared = dict(flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        rings = mmap.mmap(ring, max(sq_array + 4 * sq_entries, cqes + CQE.size * cq_entries), **shared)
        sqes = mmap.mmap(ring, 64 * sq_entries, offset=IORING_OFF_SQES, **shared)
        buf = ctypes.create_string_buffer(data, len(data))
        SQE.pack_into(sqes, 0, IORING_OP_WRITE, 0, 0, fd, offset, ctypes.addressof(buf), len(data), 0, 1)
        tail = U32.unpack_from(rings, sq_tail)[0]
        U32.pack_into(rings, sq_array + 4 * (tail & U32.unpack_from(rings, sq_mask)[0]), 0)
        U32.pack_into(rings, sq_tail, tail + 1)
        if libc.syscall(SYS_IO_URING_ENTER, ring, 1, 1, IORING_ENTER_GETEVENTS, None, 0) < 0:
            raise OSError(ctypes.get_errno(), "io_uring_enter")
        head = U32.unpack_from(rings, cq_head)[0]
        res = CQE.unpack_from(rings, cqes + CQE.size * (head & U32.unpack_from(rings, cq_mask)[0]))[1]
        U32.pack_into(rings, cq_head, head + 1)
        sqes.close()
        rings.close()
        return res
    finally:
        os.close(ring)
