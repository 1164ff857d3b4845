"""Paths the sudo user names are opened with that user's rights, not root's.

Under sudo, trainbpf runs as root for a user who chose every path on its command line
and in their config.  Checking those paths against the user's rights and then opening
them as root leaves a race (a folder swapped for a symlink between the check and the
open) and a second opinion that can be wrong (a file 0644 inside a root-only folder).
So none is opened as root: a small helper process running as SUDO_UID/SUDO_GID, with
that user's groups, opens or creates each file and makes each link, rename and unlink,
relative to a folder's descriptor opened once, and hands the descriptors back over a
unix socket (SCM_RIGHTS).  The kernel checks every step as that user; root only reads
and writes the descriptors it is handed, and never changes their owner or mode (the
helper does, as the user, on files of its own).

Without sudo (root as itself, a plain user, or root's own scratch: `as_root`) the same
operations run in this process.  One interface (`files()`), two transports; an error
in either is an OSError with its errno, so callers word it the same way.

This module is also the helper's program (``python -I -m trainbpf.trace.asuser``): it uses
the standard library only, so the helper starts fast and loads nothing else.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import fcntl
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Iterator

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400
RENAME_NOREPLACE = 1
_PR_SET_PDEATHSIG = 1
_MESSAGE_MAX = 1 << 16


@dataclass(frozen=True)
class Invoker:
    """The user who ran sudo: their paths are opened with their rights."""

    uid: int
    gid: int
    groups: frozenset[int]


def invoker() -> Invoker | None:
    """SUDO_UID/SUDO_GID when running as root under sudo for another user, else None."""
    if os.geteuid() != 0:
        return None
    try:
        uid, gid = int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    except (KeyError, ValueError):
        return None
    if uid == 0:
        return None
    try:
        groups = frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):
        groups = frozenset({gid})
    return Invoker(uid, gid, groups)


# -- the operations: run in this process, or in the helper as the user ---------------------

def _raise_errno(name: bytes) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), os.fsdecode(name))


def _open(fds: list[int], path: bytes, flags: int, mode: int) -> int:
    """open(2), relative to the folder descriptor fds[0] when given."""
    return os.open(path, flags | os.O_CLOEXEC, mode, dir_fd=fds[0] if fds else None)


def _link(fds: list[int], name: bytes) -> None:
    """Give the open file fds[0] (an O_TMPFILE) the name `name` in folder fds[1];
    EEXIST when taken.  linkat of /proc/self/fd/N needs no privilege, unlike AT_EMPTY_PATH."""
    fd, dirfd = fds
    if _libc.linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), dirfd, name, _AT_SYMLINK_FOLLOW):
        _raise_errno(name)


def rename_at(dirfd: int | None, src: bytes, dst: bytes, flags: int) -> None:
    """renameat2 within one folder (None: the working folder).  RENAME_NOREPLACE falls
    back to link + unlink where the kernel or file system lacks it: never replaces."""
    at = _AT_FDCWD if dirfd is None else dirfd
    if _libc.renameat2(at, src, at, dst, flags) == 0:
        return
    err = ctypes.get_errno()
    if not (flags & RENAME_NOREPLACE and err in (errno.EINVAL, errno.ENOSYS)):
        raise OSError(err, os.strerror(err), os.fsdecode(dst))
    os.link(src, dst, src_dir_fd=dirfd, dst_dir_fd=dirfd, follow_symlinks=False)  # EEXIST if taken
    os.unlink(src, dir_fd=dirfd)


def _rename(fds: list[int], src: bytes, dst: bytes, flags: int) -> None:
    rename_at(fds[0], src, dst, flags)


def _unlink(fds: list[int], name: bytes) -> None:
    os.unlink(name, dir_fd=fds[0])


def _fchmod(fds: list[int], mode: int) -> None:
    os.fchmod(fds[0], mode)


# name: (function, argument types, descriptors it takes, whether it returns one)
OPERATIONS = {
    "open": (_open, (bytes, int, int), (0, 1), True),
    "link": (_link, (bytes,), (2,), False),
    "rename": (_rename, (bytes, bytes, int), (1,), False),
    "unlink": (_unlink, (bytes,), (1,), False),
    "fchmod": (_fchmod, (int,), (1,), False),
}


class Files:
    """Opening, creating, linking, renaming and unlinking as the user whose rights apply."""

    uid: int  # who owns what these create
    who: Invoker | None = None  # the sudo user, when it is their rights that apply

    def call(self, op: str, args: tuple, fds: tuple[int, ...] = ()) -> int | None:
        raise NotImplementedError

    def open(self, path: bytes, flags: int, mode: int = 0, *, dirfd: int | None = None) -> int:
        fd = self.call("open", (path, flags, mode), () if dirfd is None else (dirfd,))
        assert fd is not None
        return fd

    def link(self, fd: int, dirfd: int, name: bytes) -> None:
        self.call("link", (name,), (fd, dirfd))

    def rename(self, dirfd: int, src: bytes, dst: bytes, flags: int = 0) -> None:
        self.call("rename", (src, dst, flags), (dirfd,))

    def unlink(self, dirfd: int, name: bytes) -> None:
        self.call("unlink", (name,), (dirfd,))

    def fchmod(self, fd: int, mode: int) -> None:
        self.call("fchmod", (mode,), (fd,))


class _InProcess(Files):
    @property
    def uid(self) -> int:  # type: ignore[override]
        return os.geteuid()

    def call(self, op: str, args: tuple, fds: tuple[int, ...] = ()) -> int | None:
        return OPERATIONS[op][0](list(fds), *args)


def _encode(op: str, args: tuple) -> bytes:
    return json.dumps([op, [a.decode("latin-1") if isinstance(a, bytes) else a for a in args]]).encode()


def _decode(data: bytes, nfds: int) -> tuple[str, list]:
    """A request, checked against OPERATIONS (ValueError otherwise)."""
    op, raw = json.loads(data)
    function, types, fd_counts, _ = OPERATIONS[op]
    if nfds not in fd_counts or len(raw) != len(types):
        raise ValueError(op)
    args = []
    for value, typ in zip(raw, types):
        if typ is bytes and isinstance(value, str):
            value = value.encode("latin-1")
        if type(value) is not typ:
            raise ValueError(op)
        args.append(value)
    return op, args


class _Helper(Files):
    """The helper process, started at first use and kept for the process's life (it
    ends at the end of its socket, or with this process: PR_SET_PDEATHSIG)."""

    def __init__(self, who: Invoker):
        self.who = who
        self.uid = who.uid
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one request and its reply at a time

    def _start(self) -> None:
        if self._sock is not None:
            self._sock.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # fork+exec from C (safe with threads); -I: nothing from the user's
            # environment or home is imported; its own session: a terminal's Ctrl-C
            # stops the recording, not the helper that must still publish it.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-m", "trainbpf.trace.asuser", str(theirs.fileno()), str(os.getpid())],
                user=self.who.uid, group=self.who.gid, extra_groups=sorted(self.who.groups),
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env={"PATH": os.defpath}, cwd=None, start_new_session=True)
        except OSError as exc:  # e.g. the interpreter is not the user's to run
            raise OSError(exc.errno, f"cannot start the helper that opens files as uid {self.uid} "
                                     f"({exc.strerror})") from None
        finally:
            theirs.close()
        self._sock = ours

    def call(self, op: str, args: tuple, fds: tuple[int, ...] = ()) -> int | None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._sock is not None
            try:
                socket.send_fds(self._sock, [_encode(op, args)], list(fds))
                data, got, _, _ = socket.recv_fds(self._sock, _MESSAGE_MAX, 1)
            except OSError:
                data, got = b"", []
        return self._reply(op, args, data, got)

    def _reply(self, op: str, args: tuple, data: bytes, got: list[int]) -> int | None:
        """The helper's answer: a descriptor, nothing, or its errno as OSError.  Whatever
        it sends is only what the user could do: a descriptor must at least be what was
        asked for (the access mode of an open), so root never writes a read-only file."""
        try:
            reply = json.loads(data) if data else None
            if not isinstance(reply, dict):
                raise OSError(errno.EPIPE, f"the helper that opens files as uid {self.uid} ended")
            if isinstance(reply.get("errno"), int):
                name = args[0] if args and isinstance(args[0], bytes) else None
                raise OSError(reply["errno"], os.strerror(reply["errno"]), name and os.fsdecode(name))
            if not OPERATIONS[op][3]:
                return None
            if len(got) != 1 or fcntl.fcntl(got[0], fcntl.F_GETFL) & (os.O_ACCMODE | os.O_PATH) != \
                    args[1] & (os.O_ACCMODE | os.O_PATH):
                raise OSError(errno.EPROTO, f"the helper that opens files as uid {self.uid} answered wrongly")
            fd = got.pop()
            os.set_inheritable(fd, False)
            return fd
        finally:
            for fd in got:
                os.close(fd)


_IN_PROCESS = _InProcess()
_helper: _Helper | None = None
_helper_lock = threading.Lock()
_as_root = contextvars.ContextVar("trainbpf_as_root", default=False)


def files() -> Files:
    """How this process opens the paths it is given: as the sudo user, through the
    helper, or (without sudo, or inside `as_root`) itself."""
    global _helper
    who = None if _as_root.get() else invoker()
    if who is None:
        return _IN_PROCESS
    with _helper_lock:
        if _helper is None or _helper.who != who:
            _helper = _Helper(who)
        return _helper


@contextlib.contextmanager
def as_root() -> Iterator[None]:
    """Files opened within are root's own (health's private scratch), not the sudo
    user's: opened by this process, with its rights."""
    token = _as_root.set(True)
    try:
        yield
    finally:
        _as_root.reset(token)


# -- the helper's program ---------------------------------------------------------------

def _serve(sock: socket.socket) -> None:
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_MAX, 4)
        except OSError:
            return
        if not data:
            return  # the other end closed: root is done or gone
        result = None
        try:
            op, args = _decode(data, len(fds))
            result = OPERATIONS[op][0](fds, *args)
            reply = {"ok": True}
        except OSError as exc:
            reply = {"errno": exc.errno or errno.EIO}
        except (ValueError, TypeError, KeyError):
            reply = {"errno": errno.EINVAL}
        try:
            socket.send_fds(sock, [json.dumps(reply).encode()], [result] if isinstance(result, int) else [])
        except OSError:
            return
        finally:
            for fd in fds + ([result] if isinstance(result, int) else []):
                os.close(fd)


def main(argv: list[str]) -> int:
    sock_fd, parent = int(argv[1]), int(argv[2])
    # Ends with its socket, never by a terminal's or a service manager's signal while
    # root still needs it; and with root (the death signal, set after the uid change,
    # which clears it).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        return 0
    _serve(socket.socket(fileno=sock_fd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
