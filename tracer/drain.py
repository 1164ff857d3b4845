"""The recorder's drain loop: it sleeps in one epoll until there is something to do, and
flushes the ring buffers into the spool (tracer/record.py's Recorder runs it)."""

from __future__ import annotations

import os
import time

from trainbpf.tracer import proctree

FLUSH_INTERVAL_S = 1.0
# Where the wait cannot be woken by what ends it (no pidfd, or bcc's own ring-buffer
# poll), the loop looks again this often.
POLL_S = 0.1
FINAL_DRAIN_PASSES = 4  # bounded: a target still running keeps producing


class DrainLoop:
    """The drain part of a Recorder: the state it uses (pid, rings, sources, writer,
    the stop event and pipe, counters) and _flush are the Recorder's."""

    def _drain(self) -> None:
        target = proctree.Liveness(self.pid) if self.pid is not None else None
        with self._stop_fds_lock:
            self._stop_fds = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            if self._stop.is_set():  # asked before the pipe existed
                os.write(self._stop_fds[1], b"x")
        try:
            self._drain_until_stop(target)
        finally:
            with self._stop_fds_lock:
                fds, self._stop_fds = self._stop_fds, None
                for fd in fds:
                    os.close(fd)
            if target is not None:
                target.close()

    def _drain_until_stop(self, target: proctree.Liveness | None) -> None:
        """Wake only when there is something to do: a flush, a source's sample, a ring
        buffer filling (probes/common.h submit_flags), the target's exit, a stop request
        or the duration's end.  Each wake-up of this process costs ~0.1-0.2 ms of CPU
        with its caches cold (docs/performance.md), so nothing is polled for nothing."""
        start = self.start_ns / 1e9
        deadline = start + self.duration if self.duration else None
        next_flush = start + FLUSH_INTERVAL_S
        samplers = [s for s in self.sources if s.sample_interval_ns()]
        sample_s = min((c.sample_interval_ns() for c in samplers), default=0) / 1e9
        woken = self.rings.watch(self._stop_fds[0]) and (target is None or target.fd is not None
                                                         and self.rings.watch(target.fd))
        while True:
            now = time.monotonic()
            wake_at = min(t for t in (next_flush, deadline, sample_s and now + sample_s,
                                      not woken and now + POLL_S) if t)
            self.rings.poll(max(0.0, wake_at - now))
            now = time.monotonic()
            for c in samplers:
                c.sample(time.monotonic_ns())
            if deadline and now >= deadline:
                self.request_stop("duration")
            if target is not None and not target.alive():
                self.request_stop("target exited")
            # Read once: a signal arriving during the flush below must not end the loop
            # before the ring buffers are drained, so it takes effect next time round.
            stopping = self._stop.is_set()
            if now >= next_flush or stopping:
                # what is in the ring buffers; at the stop, what is still arriving too
                self.rings.drain(passes=FINAL_DRAIN_PASSES if stopping else 1)
                self._flush(final=stopping)
                next_flush = now + FLUSH_INTERVAL_S
                if self.writer.failed:
                    self.request_stop("output failed")
                if self.status:
                    self.status(f"recording {now - start:6.1f}s  events {self.rows}  "
                                f"lost {sum(self.lost.values())}  written {self.writer.bytes_written / 1e6:.1f} MB")
            if stopping:
                break
