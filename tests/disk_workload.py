"""A process tree for tests/test_disk_probe.py (the protocol of tests/recording.py: it
says "ready", waits for "go", prints what it did as JSON, exits): one child writes a new
file buffered and keeps it open, the parent syncs (the flusher writes it back), another
child reads a file with O_DIRECT."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20


def writer(path: str, size: int) -> None:
    """Write `size` bytes buffered to a new file, say so, hold it open until stdin ends."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    block = os.urandom(CHUNK)
    for _ in range(size // CHUNK):
        os.write(fd, block)
    print(json.dumps({"tid": threading.get_native_id(), "bytes": size}), flush=True)
    sys.stdin.read()
    os.close(fd)


def reader(path: str) -> None:
    """Read `path` whole with O_DIRECT (aligned buffers, straight from the disk)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf, total = mmap.mmap(-1, CHUNK), 0
    while (n := os.readv(fd, [buf])) > 0:
        total += n
    os.close(fd)
    print(json.dumps({"tid": threading.get_native_id(), "bytes": total}), flush=True)


def main(written: str, size: int, read: str, hold_s: float) -> None:
    print("ready", flush=True)
    sys.stdin.readline()
    me = [sys.executable, __file__]
    w = subprocess.Popen(me + ["writer", written, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    wrote = json.loads(w.stdout.readline())
    os.sync()  # the flusher writes the new file back, now, inside the recording
    r = subprocess.run(me + ["reader", read], stdout=subprocess.PIPE, text=True, check=True)
    time.sleep(hold_s)  # the file stays open past a flush, which names it
    w.stdin.close()
    w.wait()
    print(json.dumps({"writer": wrote, "reader": json.loads(r.stdout), "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "writer":
        writer(args[0], int(args[1]))
    elif what == "reader":
        reader(args[0])
    else:
        main(what, int(args[0]), args[1], float(args[2]))
