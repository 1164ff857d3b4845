"""Creating and reading files safely from a process that may be root.

`trainbpf record` (and `health`, and anything run under sudo) writes into folders that
other users may write too: their home, a sticky /tmp.  Every output therefore goes
through here (docs/security.md states the rules):

- nothing is opened by a predictable name that a planted symlink could redirect: a new
  file is an unnamed O_TMPFILE (or O_CREAT|O_EXCL|O_NOFOLLOW with a random name), given
  its owner and mode on the descriptor, and linked into place only when complete;
- an existing file is never replaced unless the caller says so (``--force``), never when
  it is not a regular file, and under sudo never when the invoking user could not have
  replaced it; a link that would replace nothing uses linkat/renameat2 RENAME_NOREPLACE;
- inputs are opened without blocking (a FIFO is refused, not waited on) and, under sudo,
  only when the invoking user could read them;
- paths stay what the user gave (bytes that need not be UTF-8 travel as surrogate
  escapes); files are handed to pyarrow as /proc/self/fd/N, never by their name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from trainbpf.errors import OutputError, TraceReadError

_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400


@dataclass(frozen=True)
class Invoker:
    """The user who ran sudo: outputs become theirs, and are checked with their rights."""

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


def _may(st: os.stat_result, who: Invoker, bits: int) -> bool:
    """Whether `who` has the permission `bits` (4 read, 2 write, 1 search) on `st`."""
    if st.st_uid == who.uid:
        mode = st.st_mode >> 6
    elif st.st_gid in who.groups:
        mode = st.st_mode >> 3
    else:
        mode = st.st_mode
    return mode & bits == bits


def _user(who: Invoker) -> str:
    return f"uid {who.uid} (SUDO_UID)"


def check_output(path: str | os.PathLike, *, force: bool = False, what: str = "output") -> None:
    """Fail before anything is written when `path` cannot or must not be written: its
    folder missing or (for the invoking user, under sudo) not writable; `path` a folder,
    a symlink or a device; `path` existing without `force`, or one the invoking user
    could not replace."""
    path = Path(path)
    parent = path.parent
    who = invoker()
    try:
        pst = os.stat(parent)
    except OSError:
        raise OutputError(f"{what} folder {parent} does not exist") from None
    if not stat.S_ISDIR(pst.st_mode):
        raise OutputError(f"{what} folder {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (who and not _may(pst, who, 3)):
        raise OutputError(f"{what} folder {parent} is not writable" + (f" by {_user(who)}" if who else ""))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{what} {path} is a folder; give a file name such as trace.parquet")
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise OutputError(f"{what} {path} is {kind}; refusing to replace it")
    if not force:
        raise OutputError(f"{what} {path} exists; give --force to replace it")
    if who:
        sticky_owner = not pst.st_mode & stat.S_ISVTX or who.uid in (st.st_uid, pst.st_uid)
        if not (_may(st, who, 2) and sticky_owner):
            raise OutputError(f"{path} is not replaceable by {_user(who)}; refusing to replace it")


def fd_path(fd: int) -> str:
    """A name for an open descriptor that no rename or symlink can redirect."""
    return f"/proc/self/fd/{fd}"


def _hand_over(fd: int, mode: int, owner: Invoker | None) -> None:
    if owner is not None:
        os.fchown(fd, owner.uid, owner.gid)
    os.fchmod(fd, mode)  # after the chown, and whatever the umask


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{os.fsdecode(path.name)}.{secrets.token_hex(6)}.tmp")


def create_exclusive(path: str | os.PathLike, *, mode: int = 0o600, owner: Invoker | None = None,
                     flags: int = os.O_WRONLY) -> int:
    """Create `path` (which must not exist, not even as a symlink) and return its
    descriptor, already owned by `owner` and of `mode`."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        _hand_over(fd, mode, owner)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd


def _unnamed(folder: Path, mode: int) -> int | None:
    """An O_TMPFILE in `folder`, or None where the file system has none."""
    try:
        return os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError): renameat2
    RENAME_NOREPLACE, or link + unlink where the kernel or file system lacks it."""
    res = _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
    if res == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOSYS):
        raise OSError(err, os.strerror(err), os.fsdecode(dst))
    os.link(src, dst, follow_symlinks=False)  # EEXIST when dst exists: never replaces
    os.unlink(src)


def _link_fd(fd: int, dst: str | os.PathLike) -> None:
    """Give the open file `fd` (an O_TMPFILE) the name `dst`; FileExistsError if taken.
    Through linkat itself: os.link calls link(2), which does not follow /proc/self/fd."""
    if _libc.linkat(_AT_FDCWD, os.fsencode(fd_path(fd)), _AT_FDCWD, os.fsencode(dst), _AT_SYMLINK_FOLLOW):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(dst))


def same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def publish(fd: int, path: str | os.PathLike, *, force: bool = False, temp: Path | None = None) -> None:
    """Give the complete file open as `fd` the name `path`.  `temp` is its current name
    (None for an O_TMPFILE).  Without `force` an existing `path` is never replaced;
    with it, only a regular file the invoking user could replace (check_output)."""
    path = Path(path)
    try:
        if not force:
            if temp is None:
                _link_fd(fd, path)  # EEXIST: never replaces
            else:
                rename_noreplace(temp, path)
        else:
            if temp is None:
                temp = _temp_name(path)
                _link_fd(fd, temp)
            check_output(path, force=True)
            os.rename(temp, path)  # swaps names only: never writes through what it replaces
    except FileExistsError:
        raise OutputError(f"output {path} exists; give --force to replace it") from None
    finally:
        if temp is not None and same_file(fd, temp):
            os.unlink(temp)
    if not same_file(fd, path):
        raise OutputError(f"output {path} was replaced by another file while it was written")


def write_new(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, mode: int = 0o600,
              owner: Invoker | None = None, force: bool = False) -> Path:
    """Write a whole file with `write(fh)` out of sight, then publish it at `path`.
    OSError becomes OutputError (disk full said so)."""
    path = Path(path)
    check_output(path, force=force)
    temp = None
    fd = _unnamed(path.parent, mode)
    try:
        if fd is None:
            temp = _temp_name(path)
            fd = create_exclusive(temp, mode=mode, owner=None, flags=os.O_RDWR)
        _hand_over(fd, mode, owner)
        with os.fdopen(os.dup(fd), "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        publish(fd, path, force=force, temp=temp)
    except OSError as exc:
        raise output_error(path, exc) from None
    finally:
        if fd is not None:
            if temp is not None and same_file(fd, temp):
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            os.close(fd)
    return path


def output_error(path: Path, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {path}")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


def open_input(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file `path`.  Never blocks (a FIFO or a
    device is refused), and under sudo refuses a file the invoking user could not read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TraceReadError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceReadError(f"{path}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise TraceReadError(f"{path}: is a directory, not a trace file")
        if not stat.S_ISREG(st.st_mode):
            raise TraceReadError(f"{path}: not a regular file (a FIFO, socket or device); give a trace file")
        who = invoker()
        if who and not _may(st, who, 4):
            raise TraceReadError(f"{path}: not readable by {_user(who)}; refusing to read it as root")
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file open as `fd` (from /proc/locks), if any."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
                    return int(parts[4])
    except OSError:
        pass
    return None


def try_lock(fd: int) -> bool:
    """An exclusive, non-blocking flock on `fd`; False when another process holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
