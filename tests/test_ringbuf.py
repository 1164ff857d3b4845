"""The bulk ring-buffer reader against a simulated BPF ring buffer (the kernel's layout:
8-byte headers with BUSY/DISCARD bits, a data area mapped twice).  The real-kernel tests
read real ones."""

from __future__ import annotations

import numpy as np

from trainbpf.tracer.ringbuf import BUSY, DISCARD, HEADER, MappedRing

EVENT = np.dtype([("ts_ns", "<u8"), ("tid", "<u4"), ("pid", "<u4")])
SIZE = 256  # data area; a power of two like the kernel's


class FakeProducer:
    """Writes records the way bpf_ringbuf_reserve/submit do, into both copies of the
    data area (the kernel maps it twice; here two halves mirror each other)."""

    def __init__(self):
        self.data = np.zeros(2 * SIZE, np.uint8)
        self.consumer = np.zeros(1, np.uint64)
        self.producer = np.zeros(1, np.uint64)

    def _write(self, pos: int, raw: bytes) -> None:
        for i, b in enumerate(raw):
            at = (pos + i) % SIZE
            self.data[at] = self.data[at + SIZE] = b

    def reserve(self, length: int = EVENT.itemsize) -> int:
        pos = int(self.producer[0])
        self._write(pos, np.array([length | BUSY, 0], np.uint32).tobytes())
        self.producer[0] = pos + ((HEADER + length + 7) & ~7)
        return pos

    def commit(self, pos: int, payload: bytes, *, discard: bool = False) -> None:
        self._write(pos + HEADER, payload)
        self._write(pos, np.array([len(payload) | (DISCARD if discard else 0)], np.uint32).tobytes())

    def emit(self, ts: int, *, discard: bool = False) -> int:
        pos = self.reserve()
        self.commit(pos, event(ts).tobytes(), discard=discard)
        return pos

    def reader(self) -> MappedRing:
        return MappedRing(self.consumer, self.producer, self.data, EVENT)


def event(ts: int) -> np.ndarray:
    return np.array([(ts, ts + 1, 7)], dtype=EVENT)


def drained_ts(ring: MappedRing, passes: int = 1) -> list[int]:
    ring.drain(passes)
    got = ring.take()
    return [] if got is None else got["ts_ns"].tolist()


def test_reads_committed_records_in_order_and_frees_their_space():
    p = FakeProducer()
    for ts in range(5):
        p.emit(ts)
    ring = p.reader()
    ring.drain()
    got = ring.take()
    assert got["ts_ns"].tolist() == [0, 1, 2, 3, 4]
    assert got["tid"].tolist() == [1, 2, 3, 4, 5]
    assert int(p.consumer[0]) == int(p.producer[0])


def test_stops_at_a_record_still_being_written():
    p = FakeProducer()
    p.emit(1)
    busy = p.reserve()
    p.emit(3)  # committed after a busy one: must wait for it
    ring = p.reader()
    assert drained_ts(ring) == [1]
    assert int(p.consumer[0]) == busy
    p.commit(busy, event(2).tobytes())
    assert drained_ts(ring) == [2, 3]


def test_skips_discarded_records():
    p = FakeProducer()
    p.emit(1)
    p.emit(2, discard=True)
    p.emit(3)
    ring = p.reader()
    assert drained_ts(ring) == [1, 3]
    assert int(p.consumer[0]) == int(p.producer[0])


def test_records_wrapping_past_the_end_of_the_data_area():
    p = FakeProducer()
    ring = p.reader()
    seen = []
    for ts in range(40):  # 24-byte records in 256 bytes: wraps several times, mid-record too
        p.emit(ts)
        if ts % 3 == 2:
            seen += drained_ts(ring)
    seen += drained_ts(ring)
    assert seen == list(range(40))


def test_records_of_another_size_are_skipped_record_by_record():
    p = FakeProducer()
    p.emit(1)
    other = p.reserve(8)
    p.commit(other, b"\x01" * 8)
    p.emit(3)
    ring = p.reader()
    assert drained_ts(ring) == [1, 3]
    assert int(p.consumer[0]) == int(p.producer[0])


def test_drained_records_are_copies():
    p = FakeProducer()
    p.emit(5)
    ring = p.reader()
    ring.drain()
    p.data[:] = 0xFF  # the kernel reuses the space once the consumer moves on
    assert ring.take()["ts_ns"].tolist() == [5]


def test_one_pass_per_drain_unless_asked_for_more():
    p = FakeProducer()
    ring = p.reader()
    p.emit(1)
    busy = p.reserve()
    assert drained_ts(ring, passes=4) == [1]
    p.commit(busy, event(2).tobytes())
    p.emit(3)
    assert drained_ts(ring, passes=4) == [2, 3]
