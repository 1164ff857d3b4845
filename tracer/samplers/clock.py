"""The offset between the wall clock that GPU drivers stamp samples with and the trace's
CLOCK_MONOTONIC.  It changes whenever the wall clock is stepped (NTP, a VM's time agent),
so converters measure it where they convert, not once at start."""

from __future__ import annotations

import time


def wall_minus_mono_ns() -> int:
    """CLOCK_REALTIME minus CLOCK_MONOTONIC, from the tightest of a few brackets: a
    preemption between two reads would shift every converted sample by its length."""
    best = None
    for _ in range(5):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) // 2)
    return best[1]
