"""Creating and reading files safely from a process that may be root.

`trainbpf record` (and `health`, and anything run under sudo) writes into folders that
other users may write too: their home, a sticky /tmp.  Every output therefore goes
through here (docs/security.md states the rules):

- every path is opened as the user who named it (trainbpf.trace.asuser: under sudo, a helper
  running as that user), so the kernel decides what may be read, created or replaced;
- an output's folder is opened once, and every later check, create, link, rename and
  unlink is made relative to that descriptor: the file lands in the folder that was
  checked, whatever its name points at later;
- nothing is opened by a predictable name that a planted symlink could redirect: a new
  file is an unnamed O_TMPFILE (or O_CREAT|O_EXCL|O_NOFOLLOW with a random name), given
  its mode on the descriptor, and linked into place only when complete;
- an existing file is never replaced unless the caller says so (``--force``), never when
  it is not a regular file, and under sudo never when the invoking user could not have
  replaced it; a link that would replace nothing uses linkat/renameat2 RENAME_NOREPLACE;
- inputs are opened without blocking (a FIFO is refused, not waited on);
- paths stay what the user gave (bytes that need not be UTF-8 travel as surrogate
  escapes); files are handed to pyarrow as /proc/self/fd/N, never by their name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Callable

from trainbpf.trace.asuser import RENAME_NOREPLACE, Invoker, files, rename_at
from trainbpf.trace.errors import OutputError, TraceReadError, UsageError


NAME_MAX = 255  # bytes in one file name (Linux file systems)
SMALL_FILE_MAX = 1 << 20  # a topology or a config: anything larger is not one


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


class OutputFile:
    """An output `path`: its folder opened once, as the user whose rights apply, and
    every later check, create, link, rename and unlink made relative to that descriptor.
    A context manager (closes the folder)."""

    def __init__(self, path: str | os.PathLike, *, force: bool = False, what: str = "output"):
        self.path = Path(path)
        self.force = force
        self.what = what
        self.name = os.fsencode(self.path.name)
        self.files = files()
        parent = self.path.parent
        try:
            self.dirfd = self.files.open(os.fsencode(parent), os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            raise OutputError(f"{what} folder {parent} does not exist") from None
        except NotADirectoryError:
            raise OutputError(f"{what} folder {parent} is not a folder") from None
        except OSError as exc:
            raise OutputError(f"{what} folder {parent}: {exc.strerror}") from None

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        if self.dirfd >= 0:
            os.close(self.dirfd)
            self.dirfd = -1

    def lstat(self, name: bytes) -> os.stat_result:
        return os.stat(name, dir_fd=self.dirfd, follow_symlinks=False)

    def check(self) -> None:
        """Fail before anything is written when the file cannot or must not be written:
        its folder (for the invoking user, under sudo) not writable; the name too long,
        a folder, a symlink or a device; existing without `force`, or one the invoking
        user could not replace."""
        path, parent, who = self.path, self.path.parent, self.files.who
        pst = os.fstat(self.dirfd)
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=self.dirfd) or (who and not _may(pst, who, 3)):
            raise OutputError(f"{self.what} folder {parent} is not writable" + (f" by {_user(who)}" if who else ""))
        if len(self.name) > NAME_MAX:
            raise OutputError(f"{self.what} {path}: the name is too long ({len(self.name)} bytes; "
                              f"a file name holds at most {NAME_MAX})")
        try:
            st = self.lstat(self.name)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {exc.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{self.what} {path} is a folder; give a file name such as trace.parquet")
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise OutputError(f"{self.what} {path} is {kind}; refusing to replace it")
        if not self.force:
            raise OutputError(f"{self.what} {path} exists; give --force to replace it")
        if who:
            sticky_owner = not pst.st_mode & stat.S_ISVTX or who.uid in (st.st_uid, pst.st_uid)
            if not (_may(st, who, 2) and sticky_owner):
                raise OutputError(f"{path} is not replaceable by {_user(who)}; refusing to replace it")

    def create(self, name: bytes, *, mode: int = 0o600, flags: int = os.O_WRONLY) -> int:
        """Create `name` in the folder (it must not exist, not even as a symlink) and
        return its descriptor, of `mode`."""
        fd = self.files.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dirfd=self.dirfd)
        try:
            self.files.fchmod(fd, mode)  # whatever the umask
        except OSError:
            self.remove_if_same(fd, name)
            os.close(fd)
            raise
        return fd

    def holds(self, fd: int, name: bytes) -> bool:
        """Whether `name` in the folder is the open file `fd`."""
        try:
            a, b = os.fstat(fd), self.lstat(name)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def remove_if_same(self, fd: int, name: bytes) -> bool:
        """Unlink `name` if it still is the open file `fd` (not a file swapped in)."""
        if not self.holds(fd, name):
            return False
        with contextlib.suppress(OSError):
            self.files.unlink(self.dirfd, name)
            return True
        return False

    def write(self, write: Callable[[BinaryIO], None], *, mode: int = 0o600) -> Path:
        """Write the whole file with `write(fh)` out of sight, then publish it; returns
        where it is.  OSError becomes OutputError (disk full said so)."""
        temp = None
        fd = _unnamed(self, mode)
        try:
            if fd is None:
                temp = _temp_name(self.name)
                fd = self.create(temp, mode=mode, flags=os.O_RDWR)
            else:
                self.files.fchmod(fd, mode)
            with os.fdopen(os.dup(fd), "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            self.publish(fd, temp)
        except OSError as exc:
            raise output_error(self.path, exc) from None
        finally:
            if fd is not None:
                if temp is not None:
                    self.remove_if_same(fd, temp)
                os.close(fd)
        return self.where()

    def publish(self, fd: int, temp: bytes | None = None) -> None:
        """Give the complete file open as `fd` its name.  `temp` is its current name
        (None for an O_TMPFILE).  Without `force` an existing file is never replaced;
        with it, only a regular file the invoking user could replace (check)."""
        try:
            if not self.force:
                if temp is None:
                    self.files.link(fd, self.dirfd, self.name)  # EEXIST: never replaces
                else:
                    self.files.rename(self.dirfd, temp, self.name, RENAME_NOREPLACE)
            else:
                if temp is None:
                    temp = _temp_name(self.name)
                    self.files.link(fd, self.dirfd, temp)
                self.check()  # what the name is now, in the same folder
                self.files.rename(self.dirfd, temp, self.name)  # swaps names: never writes through
        except FileExistsError:
            raise OutputError(f"output {self.path} exists; give --force to replace it") from None
        finally:
            if temp is not None:
                self.remove_if_same(fd, temp)
        if not self.holds(fd, self.name):
            raise OutputError(f"output {self.path} was replaced by another file while it was written")

    def where(self) -> Path:
        """The file's path now: as given, unless its folder has moved since it was opened."""
        try:
            now = os.readlink(fd_path(self.dirfd))
        except OSError:
            return self.path
        if os.path.realpath(self.path.parent) == now:
            return self.path
        return Path(now) / os.fsdecode(self.name)

    def size(self) -> int:
        return self.lstat(self.name).st_size


def check_output(path: str | os.PathLike, *, force: bool = False, what: str = "output") -> OutputFile:
    """The output `path` with its folder opened and checked (OutputFile.check); the
    caller writes through it and closes it."""
    out = OutputFile(path, force=force, what=what)
    try:
        out.check()
    except BaseException:
        out.close()
        raise
    return out


def fd_path(fd: int) -> str:
    """A name for an open descriptor that no rename or symlink can redirect."""
    return f"/proc/self/fd/{fd}"


def _temp_name(name: bytes) -> bytes:
    return b"." + name + f".{secrets.token_hex(6)}.tmp".encode()


def _unnamed(folder: OutputFile, mode: int) -> int | None:
    """An O_TMPFILE in `folder`, or None where the file system has none."""
    try:
        return folder.files.open(b".", os.O_TMPFILE | os.O_RDWR, mode, dirfd=folder.dirfd)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError), in this process."""
    rename_at(None, os.fsencode(src), os.fsencode(dst), RENAME_NOREPLACE)


def write_new(path: str | os.PathLike | OutputFile, write: Callable[[BinaryIO], None], *, mode: int = 0o600,
              force: bool = False) -> Path:
    """Write a whole file with `write(fh)` out of sight, then publish it at `path` (an
    OutputFile already checked, or a path checked now); returns where it is."""
    if isinstance(path, OutputFile):
        return path.write(write, mode=mode)
    with check_output(path, force=force) as out:
        return out.write(write, mode=mode)


def output_error(path: Path, exc: OSError) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {path}")
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


class _NotRegular(Exception):
    """An input that is not a regular file, worded for a message."""


def _open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file `path`, opened as the user whose rights
    apply (the kernel checks them: OSError otherwise).  Never blocks: a FIFO or a device
    is refused (_NotRegular)."""
    fd = files().open(os.fsencode(path), os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _NotRegular("is a directory" if stat.S_ISDIR(st.st_mode) else
                          "not a regular file (a FIFO, socket or device)")
    return fd


def open_input(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular trace file `path` (_open_regular)."""
    path = Path(path)
    try:
        return _open_regular(path)
    except FileNotFoundError:
        raise TraceReadError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceReadError(f"{path}: cannot open: {exc.strerror}") from None
    except _NotRegular as exc:
        why = "is a directory, not a trace file" if str(exc) == "is a directory" else f"{exc}; give a trace file"
        raise TraceReadError(f"{path}: {why}") from None


def read_small(path: str | os.PathLike, what: str, *, limit: int = SMALL_FILE_MAX) -> bytes:
    """The bytes of a small input (a topology, a config) named by the user: a regular
    file they may read, at most `limit` bytes; UsageError "`what`: why" otherwise."""
    try:
        fd = _open_regular(Path(path))
        try:
            data = os.pread(fd, limit + 1, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise UsageError(f"{what}: {exc.strerror or exc}") from None
    except _NotRegular as exc:
        raise UsageError(f"{what}: {exc}") from None
    if len(data) > limit:
        raise UsageError(f"{what}: larger than {limit // 1024} KiB; refusing to read it")
    return data


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
