"""The one way a source plugs into a recording: BPF collectors, GPU and /proc samplers,
snapshots and symbolisers all implement `Source`, and the session (tracer/record.py's
Recorder) calls every source's hook at each phase, in the order of its list, knowing
none of them by name.

A source that needs another's data takes it through the session it is given at `open`
(the BPF object, the ring buffers, the thread table), or through the rows of a phase:
symbolisers name the stacks of the rows the collectors took at the same flush."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import pyarrow as pa

if TYPE_CHECKING:
    from trainbpf.tracer.symbols.maps import ProcMaps


class Source:
    """Every hook is optional: the base does nothing and adds no rows."""

    name: ClassVar[str]
    # True: flush() returns rows the symbolisers name (stacks, futex addresses, files)
    # and the gate drops for a process that left: the probes' events.  False: the
    # source's own samples.
    described: ClassVar[bool] = False

    def open(self, session) -> None:
        """Before the probes compile: check what the source needs (a refusal raises the
        project's error) and keep the session, whose parts later hooks read."""
        self.session = session

    def start(self) -> dict:
        """The probes are loaded, the clock not yet started: ready what takes time.
        Returns what the source adds to the trace's opening metadata."""
        return {}

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        """The recording starts: the traced tree (`walked`, proctree.ThreadInfo) is
        seeded at the session's start_ns."""
        return []

    def sample_interval_ns(self) -> int | None:
        """How often sample() must be called; None: never (the recorder then sleeps
        until a flush or a ring buffer wakes it)."""
        return None

    def sample(self, now_ns: int) -> None:
        """For what is read from user space at its own rate: called at least every
        sample_interval_ns() (and at other wake-ups of the recorder), if that is set."""

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        """Each flush (`final`: the last, at the stop): the rows since the last."""
        return []

    def describe(self, rows: pa.RecordBatch, maps: ProcMaps) -> tuple[pa.RecordBatch, list[pa.RecordBatch]]:
        """A symboliser's part of a flush: `rows` (the thread rows of every source, one
        batch) as they go on, and the rows naming what they refer to.  `maps`: the
        processes' mappings, read once for the flush."""
        return rows, []

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        """What ends at `now_ns`: at each flush but the last (`final` False) what a killed
        recording's segment would miss, at the stop what ends with the recording.
        `ended`: the rows the sources before this one gave; returns them, and its own."""
        return ended

    def exited(self, tids: list[int]) -> None:
        """Threads that exited, whose rows are written: what the source holds for them
        can go."""

    def meta(self) -> dict:
        """What the source adds to the trace metadata when the recording ends."""
        return {}

    def close(self) -> None:
        """Let go of what the source holds open; the recording is over.  Called for
        every source, opened or not."""
