"""Reading the probes' BPF ring buffers.

bcc (through libbpf) hands ring-buffer records to Python one ctypes callback at a time,
a few microseconds each; at a few hundred thousand records a second that is most of the
recorder's CPU.  Every ring buffer of ours carries one fixed-size event struct, so on
x86-64 a drain maps the records between the consumer and producer positions as one numpy
array and copies them out in one go (`MappedRing`).  Elsewhere, where reading the
producer position needs a load-acquire that Python cannot issue, bcc's callbacks remain
(`CallbackRings`).

The layout is the kernel's (kernel/bpf/ringbuf.c, as libbpf reads it): page 0 holds the
consumer position (written by the reader), page 1 the producer position, and the data
area follows, mapped twice in a row so a record that wraps reads contiguously.  Each
record starts with an 8-byte header: a u32 length whose top bits mark a record still
being written (BUSY) or dropped (DISCARD), then the payload, padded to 8 bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import select

import numpy as np

BUSY = 1 << 31
DISCARD = 1 << 30
HEADER = 8


def _round8(n: int) -> int:
    return (n + 7) & ~7


class MappedRing:
    """One ring buffer, read as arrays of `dtype` records.  `consumer` and `producer` are
    one-element u64 views of the positions, `data` the data area mapped twice over."""

    def __init__(self, consumer: np.ndarray, producer: np.ndarray, data: np.ndarray, dtype: np.dtype,
                 *, fd: int = -1, maps: tuple[mmap.mmap, ...] = ()):
        self.fd = fd
        self.dtype = np.dtype(dtype)
        self.mask = len(data) // 2 - 1
        self.stride = _round8(HEADER + self.dtype.itemsize)
        self._consumer, self._producer, self._data = consumer, producer, data
        self._maps = maps
        self.chunks: list[np.ndarray] = []

    @classmethod
    def open(cls, map_fd: int, data_size: int, dtype: np.dtype) -> "MappedRing":
        page = mmap.PAGESIZE
        consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        producer = mmap.mmap(map_fd, page + 2 * data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        return cls(np.frombuffer(consumer, dtype=np.uint64, count=1), np.frombuffer(producer, dtype=np.uint64, count=1),
                   np.frombuffer(producer, dtype=np.uint8, offset=page), dtype, fd=map_fd, maps=(consumer, producer))

    def drain(self, passes: int = 1) -> None:
        """Copy out the committed records, in at most `passes` passes over what the
        producer had reserved when each began.  One pass per poll: a producer faster than
        the reader must not keep the recorder from flushing."""
        for _ in range(passes):
            if not self._drain_once():
                return

    def _drain_once(self) -> bool:
        """One pass over what the producer has reserved; False when nothing was consumed."""
        cons = int(self._consumer[0])
        prod = int(self._producer[0])  # x86 keeps loads in order: the headers read below are as new
        if prod == cons:
            return False
        start = cons & self.mask
        span = self._data[start : start + (prod - cons)]  # contiguous: the data area is mapped twice
        n = len(span) // self.stride
        lengths = np.ndarray((n,), dtype=np.uint32, buffer=span, strides=(self.stride,)) if n else np.empty(0, np.uint32)
        busy = np.flatnonzero(lengths & BUSY)
        if len(busy):
            n = int(busy[0])  # stop at the first record still being written
            lengths = lengths[:n]
        if not n:
            return False if len(busy) else self._drain_walk(cons, prod)
        if not np.all((lengths & ~np.uint32(DISCARD)) == self.dtype.itemsize):
            return self._drain_walk(cons, prod)
        rows = span[: n * self.stride].reshape(n, self.stride)[:, HEADER : HEADER + self.dtype.itemsize]
        keep = (lengths & DISCARD) == 0
        records = (rows.copy() if keep.all() else rows[keep]).view(self.dtype).reshape(-1)  # a copy, never a view
        if len(records):
            self.chunks.append(records)
        self._consumer[0] = cons + n * self.stride  # copied out: the kernel may reuse the space
        return True

    def _drain_walk(self, cons: int, prod: int) -> bool:
        """Record by record, for records of another size (none of our probes emits them;
        they are skipped) or a tail shorter than one record."""
        got = []
        pos = cons
        while pos < prod:
            at = pos & self.mask
            header = int(np.frombuffer(self._data[at : at + 4], dtype=np.uint32)[0])
            if header & BUSY:
                break
            length = header & ~(BUSY | DISCARD)
            if not header & DISCARD and length == self.dtype.itemsize:
                got.append(self._data[at + HEADER : at + HEADER + length].copy())
            pos += _round8(HEADER + length)
        if got:
            self.chunks.append(np.concatenate(got).view(self.dtype).reshape(-1))
        self._consumer[0] = pos
        return pos != cons

    def take(self) -> np.ndarray | None:
        """Every record drained since the last take, oldest first."""
        if not self.chunks:
            return None
        chunks, self.chunks = self.chunks, []
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def close(self) -> None:
        self._consumer = self._producer = self._data = None  # views must go before their maps
        for m in self._maps:
            m.close()


class MappedRings:
    """Every ring buffer of a recording, read through their mappings and waited on with
    one epoll."""

    def __init__(self, bpf, dtypes: dict[str, np.dtype]):
        self.rings = {rb: MappedRing.open(bpf[rb].map_fd, bpf[rb].max_entries, dt) for rb, dt in dtypes.items()}
        # Edge-triggered: only a wake-up (a forced one, see probes/common.h) ends a poll
        # early; level-triggered, any record left in a ring would, and the loop would spin.
        self._epoll = select.epoll()
        for ring in self.rings.values():
            self._epoll.register(ring.fd, select.EPOLLIN | select.EPOLLET)

    def watch(self, fd: int) -> bool:
        """Let `fd` turning readable end a poll too (a pidfd, a pipe)."""
        self._epoll.register(fd, select.EPOLLIN)
        return True

    def poll(self, timeout_s: float) -> None:
        """Wait until a ring forces a wake-up, a watched fd turns readable or `timeout_s`
        pass; drain the rings that woke it (drain() takes the rest, before a flush)."""
        ready = {fd for fd, _ in self._epoll.poll(timeout_s)}
        for ring in self.rings.values():
            if ring.fd in ready:
                ring.drain()

    def drain(self, passes: int = 1) -> None:
        for ring in self.rings.values():
            ring.drain(passes)

    def take(self, rb: str) -> np.ndarray | None:
        return self.rings[rb].take()

    def close(self) -> None:
        self._epoll.close()
        for ring in self.rings.values():
            ring.close()


class CallbackRings:
    """The same through bcc: one callback per record copies its bytes; a take decodes
    them in one batch."""

    def __init__(self, bpf, dtypes: dict[str, np.dtype]):
        self.bpf = bpf
        self.dtypes = dtypes
        self.chunks: dict[str, list[bytes]] = {rb: [] for rb in dtypes}
        for rb in dtypes:
            bpf[rb].open_ring_buffer(lambda ctx, data, size, out=self.chunks[rb]: out.append(ctypes.string_at(data, size)))

    def watch(self, fd: int) -> bool:
        """bcc's poll waits on its own epoll: nothing else can end it."""
        return False

    def poll(self, timeout_s: float) -> None:
        self.bpf.ring_buffer_poll(max(0, round(timeout_s * 1000)))
        self.drain()

    def drain(self, passes: int = 1) -> None:
        self.bpf.ring_buffer_consume()  # records submitted without a wake-up

    def take(self, rb: str) -> np.ndarray | None:
        chunks, self.chunks[rb] = self.chunks[rb], []
        return np.frombuffer(b"".join(chunks), dtype=self.dtypes[rb]) if chunks else None

    def close(self) -> None:
        pass


def open_rings(bpf, dtypes: dict[str, np.dtype]) -> MappedRings | CallbackRings:
    """Readers for the ring buffers named in `dtypes` (ring -> record dtype)."""
    if platform.machine() in ("x86_64", "AMD64"):
        return MappedRings(bpf, dtypes)
    return CallbackRings(bpf, dtypes)
