"""Symbolising stack ids while the traced processes are alive, so the trace carries
readable stacks to wherever it is analysed."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from trainbpf.tracefile import make_batch

MAX_FRAMES = 32


class StackSymbolizer:
    def __init__(self, bpf):
        self.bpf = bpf
        self.done_kernel: set[int] = set()
        self.done_user: set[tuple[int, int]] = set()

    def _frames(self, stack_id: int, resolve) -> str:
        try:
            addrs = list(self.bpf["stacks"].walk(stack_id))[:MAX_FRAMES]
        except KeyError:
            return ""
        return ";".join(resolve(a) for a in addrs)

    def symbolize(self, kernel_ids, user_pairs) -> pa.RecordBatch | None:
        """Rows for ids not seen before: `kernel_ids` ids, `user_pairs` (id, pid)."""
        rows = []
        for sid in set(int(s) for s in kernel_ids) - self.done_kernel:
            if sid < 0:
                continue
            self.done_kernel.add(sid)
            rows.append((sid, "kernel", 0, self._frames(sid, self._ksym)))
        for sid, pid in set((int(s), int(p)) for s, p in user_pairs) - self.done_user:
            if sid < 0:
                continue
            self.done_user.add((sid, pid))
            rows.append((sid, "user", pid, self._frames(sid, lambda a, pid=pid: self._usym(a, pid))))
        if not rows:
            return None
        now = time.monotonic_ns()
        return make_batch("stack", {
            "ts_ns": np.full(len(rows), now, dtype=np.int64),
            "kstack_id": np.array([r[0] for r in rows], dtype=np.int32),
            "state": [r[1] for r in rows],
            "pid": np.array([r[2] for r in rows], dtype=np.int32),
            "name": [r[3] for r in rows],
        })

    def _ksym(self, addr: int) -> str:
        return self.bpf.ksym(addr).decode(errors="replace")

    def _usym(self, addr: int, pid: int) -> str:
        try:
            name = self.bpf.sym(addr, pid, show_module=True).decode(errors="replace")
        except Exception:
            name = "[unknown]"
        return name if name != "[unknown]" else f"0x{addr:x}"


def stack_refs(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(kernel ids, user (id, pid) pairs) referenced by a decoded batch."""
    names = batch.schema.names
    kernel, user = [], []
    pid = batch.column(names.index("pid")).to_numpy(zero_copy_only=False)
    peer_pid = batch.column(names.index("peer_pid")).to_numpy(zero_copy_only=False)
    for col in ("kstack_id", "peer_kstack_id"):
        arr = batch.column(names.index(col))
        if arr.null_count < len(arr):
            kernel.append(arr.drop_null().to_numpy())
    for col, pids in (("ustack_id", pid), ("peer_ustack_id", peer_pid)):
        arr = batch.column(names.index(col))
        if arr.null_count < len(arr):
            valid = arr.is_valid().to_numpy(zero_copy_only=False)
            ids = arr.drop_null().to_numpy()
            user.append(np.stack([ids, np.nan_to_num(pids[valid]).astype(np.int64)], axis=1))
    k = np.unique(np.concatenate(kernel)) if kernel else np.empty(0, np.int64)
    u = np.unique(np.concatenate(user), axis=0) if user else np.empty((0, 2), np.int64)
    return k, u
