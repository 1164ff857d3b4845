"""Symbolising stack ids while the traced processes are alive, so the trace carries
readable stacks to wherever it is analysed."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.tracefile import make_batch
from trainbpf.tracer.addrs import ProcMaps

MAX_CACHED_NAMES = 65536
MMAP_MIN_ADDR = 65536  # vm.mmap_min_addr's default; no user mapping starts lower
# A wake-up whose kernel stack holds one of these ran in interrupt context (a timer
# expiring, an I/O completing): `current` there is whoever was interrupted, not a waker.
IRQ_FRAMES = ("asm_sysvec_", "asm_common_interrupt", "__sysvec_", "sysvec_", "hrtimer_interrupt",
              "__hrtimer_run_queues", "handle_softirqs", "__do_softirq", "do_softirq", "irq_exit")


class StackSymbolizer:
    def __init__(self, bpf):
        self.bpf = bpf
        self.done_kernel: set[int] = set()
        self.done_user: set[tuple[int, int]] = set()
        self.irq_ids: set[int] = set()  # kernel stacks taken in interrupt context
        # Symbol names by address: the same frames recur in stack after stack, and each
        # lookup costs bcc time (docs/performance.md, "Costs the code is shaped by").
        self._kernel_names: dict[int, str] = {}
        self._user_names: dict[tuple[int, int], str] = {}  # (pid, addr); cleared on exec
        # The same names by (file, offset in it): a forked DataLoader worker runs the code
        # its parent ran, and bcc would load each library's symbols again for its pid
        # to name addresses already named.
        self._image_names: dict[tuple[str, int, int], str] = {}  # (device, inode, offset)

    def _frames(self, stack_id: int, resolve) -> str:
        table = self.bpf["stacks"]
        try:
            ips = table[table.Key(stack_id)].ip  # Settings.stack_frames long (probes/common.h)
        except KeyError:
            return ""
        # Not bcc's walk(): it assumes 127-frame values.  A stack ends at the first 0.
        return ";".join(resolve(a) for a in itertools.takewhile(bool, ips))

    def symbolize(self, kernel_ids, user_pairs, maps: ProcMaps | None = None) -> pa.RecordBatch | None:
        """Rows for ids not seen before: `kernel_ids` ids, `user_pairs` (id, pid);
        `maps`: this flush's process mappings."""
        maps = maps if maps is not None else ProcMaps()
        rows = []
        for sid in set(int(s) for s in kernel_ids) - self.done_kernel:
            if sid < 0:
                continue
            self.done_kernel.add(sid)
            frames = self._frames(sid, self._ksym)
            if any(f.startswith(IRQ_FRAMES) for f in frames.split(";")):
                self.irq_ids.add(sid)
            rows.append((sid, "kernel", 0, frames))
        for sid, pid in set((int(s), int(p)) for s, p in user_pairs) - self.done_user:
            if sid < 0:
                continue
            self.done_user.add((sid, pid))
            rows.append((sid, "user", pid, self._frames(sid, lambda a, pid=pid: self._usym(a, pid, maps))))
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

    def exec_seen(self) -> None:
        """A traced process exec'd: its addresses now mean other code."""
        self._user_names.clear()

    def _ksym(self, addr: int) -> str:
        name = self._kernel_names.get(addr)
        if name is None:
            if len(self._kernel_names) >= MAX_CACHED_NAMES:  # stays bounded over long recordings
                self._kernel_names.clear()
            name = self._kernel_names[addr] = self.bpf.ksym(addr).decode(errors="replace")
        return name

    def _usym(self, addr: int, pid: int, maps: ProcMaps) -> str:
        name = self._user_names.get((pid, addr))
        if name is None:
            if len(self._user_names) >= MAX_CACHED_NAMES:
                self._user_names.clear()
            name = "[unknown]"
            code = _code_at(maps, pid, addr) if addr >= MMAP_MIN_ADDR else None
            # Below mmap_min_addr, or outside the process's executable memory (while it
            # is alive to tell): a frame-pointer walk gone astray, not a return address.
            if code is not None:
                image = code if code[0] else None
                name = self._image_names.get(image) if image else None
                if name is None:
                    try:
                        name = self.bpf.sym(addr, pid, show_module=True).decode(errors="replace")
                    except Exception:
                        name = "[unknown]"
                    if image:  # "[unknown]" too: no symbol covers that offset of that file
                        if len(self._image_names) >= MAX_CACHED_NAMES:
                            self._image_names.clear()
                        self._image_names[image] = name
            name = self._user_names[(pid, addr)] = name if name != "[unknown]" else f"0x{addr:x}"
        return name


def _code_at(maps: ProcMaps, pid: int, addr: int) -> tuple[str, int, int] | None:
    """Where a user address lies in the process's executable memory: (device, inode,
    offset in the file) in a file's mapping, ("", 0, 0) in anonymous code (a JIT's), None
    outside executable memory.  The file by device and inode, not by path: in another
    mount namespace (a container) the same path can be another file.  A process already
    gone could be anywhere: ("", 0, 0), left to bcc."""
    index = maps.of(pid)
    if index is None:
        return ("", 0, 0)
    i = index.index_of(addr)
    if i < 0 or not index.maps[i].executable:
        return None
    m = index.maps[i]
    return (*m.file, addr - m.start + m.offset) if m.path.startswith("/") and m.file[1] else ("", 0, 0)


def drop_irq_wakers(batch: pa.RecordBatch, irq_ids: set[int]) -> pa.RecordBatch:
    """Null the waker of wake-ups that came from interrupt context; their peer_kstack_id
    stays and shows what woke the thread (timer, I/O completion)."""
    names = batch.schema.names
    peer_k = batch.column(names.index("peer_kstack_id"))
    if not irq_ids or peer_k.null_count == len(peer_k):
        return batch
    mask = pc.fill_null(pc.is_in(peer_k, pa.array(sorted(irq_ids), type=pa.int32())), False)
    if not pc.any(mask).as_py():
        return batch
    cols = list(batch.columns)
    for col in ("peer_tid", "peer_pid", "peer_ustack_id"):
        i = names.index(col)
        cols[i] = pc.if_else(mask, pa.nulls(len(mask), cols[i].type), cols[i])
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


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
    k = sorted_unique(np.concatenate(kernel)) if kernel else np.empty(0, np.int64)
    u = _unique_pairs(np.concatenate(user)) if user else np.empty((0, 2), np.int64)
    return k, u


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for 1-D values by sorting: numpy 2.4's np.unique is much slower
    (docs/performance.md, "Costs the code is shaped by")."""
    values = np.sort(values, kind="stable")
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


def _unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """np.unique(pairs, axis=0) for (stack id, pid) rows: each row packed into one
    64-bit key (both fit 32 bits), so the sort is a plain 1-D one."""
    pairs = pairs.astype(np.int64)
    keys = sorted_unique((pairs[:, 0] << 32) | (pairs[:, 1] & 0xFFFFFFFF))
    return np.stack([keys >> 32, keys & 0xFFFFFFFF], axis=1)
