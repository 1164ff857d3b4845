"""Separate debug files fetched from debuginfod servers by build-id, where the user asks for
it: DEBUGINFOD_URLS (space-separated http or https URLs) set in the recorder's environment,
as every setting of the recorder is (under sudo: `sudo DEBUGINFOD_URLS=... trainbpf
record`).  Without it nothing is fetched, and no connection is made.  Only the libraries
holding the futex addresses a recording names (tracer/symbols/addrs.py) are looked up: a
lock such as glibc's main_arena is named only from a stripped library's debug file.

A file is fetched as GET <url>/buildid/<hex>/debuginfo with a short timeout and a size
cap, into a folder of root's cache (CACHE, `$TRAINBPF_CACHE/debuginfod`), and kept only
where the caller found the build-id it asked for in the file itself
(tracer/symbols/elf.py): the server is no more trusted than the traced processes."""

from __future__ import annotations

import http.client
import os
import re
import stat
import tempfile
import time
import urllib.request
from pathlib import Path

from trainbpf.tracer.kheaders import CACHE_ROOT

URLS_VARIABLE = "DEBUGINFOD_URLS"
CACHE = CACHE_ROOT / "debuginfod"
MAX_BYTES = 256 << 20  # a debug file larger than this is not fetched (glibc's is ~5 MB)
TIMEOUT_S = 3.0  # each connect and read
DEADLINE_S = 10.0  # a whole fetch: it holds up the flush that names a lock address
CHUNK = 1 << 20
_BUILD_ID = re.compile(r"[0-9a-f]{2,128}")
# (URLs, build-id) no server gave in this run: asked once
_failed: set[tuple[tuple[str, ...], str]] = set()


def urls() -> tuple[str, ...]:
    """The servers the user named; those that are not http or https are left out."""
    return tuple(u.rstrip("/") for u in os.environ.get(URLS_VARIABLE, "").split()
                 if u.startswith(("http://", "https://")))


def cached(build_id: str) -> str | None:
    """The debug file of `build_id` fetched before, where the user names servers."""
    if not urls() or not _BUILD_ID.fullmatch(build_id) or not _private_folder(CACHE, create=False):
        return None
    kept = CACHE / f"{build_id}.debug"
    return str(kept) if kept.is_file() and not kept.is_symlink() else None


def download(build_id: str) -> str | None:
    """A new file in the cache folder holding what the first server that had it sent for
    `build_id`, for the caller to check, then keep() or discard(); None when no server is
    named, none gave it (an error, a timeout, over MAX_BYTES), or the cache folder is
    not root's own."""
    servers = urls()
    if not servers or not _BUILD_ID.fullmatch(build_id) or (servers, build_id) in _failed:
        return None
    if not _private_folder(CACHE, create=True):
        return None
    for url in servers:
        got = _fetch(f"{url}/buildid/{build_id}/debuginfo")
        if got:
            return got
    _failed.add((servers, build_id))
    return None


def keep(fetched: str, build_id: str) -> str:
    kept = CACHE / f"{build_id}.debug"
    os.replace(fetched, kept)
    return str(kept)


def discard(fetched: str, build_id: str) -> None:
    os.unlink(fetched)
    _failed.add((urls(), build_id))


class _HttpOnly(urllib.request.HTTPRedirectHandler):
    """Redirects to http or https only (urllib also follows ftp)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return super().redirect_request(req, fp, code, msg, headers, newurl) \
            if newurl.startswith(("http://", "https://")) else None


def _fetch(url: str) -> str | None:
    fd, partial = tempfile.mkstemp(dir=CACHE, prefix=".fetching-")
    deadline = time.monotonic() + DEADLINE_S
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.build_opener(_HttpOnly).open(url, timeout=TIMEOUT_S) as resp:
            if resp.status != 200 or int(resp.headers.get("Content-Length") or 0) > MAX_BYTES:
                raise ValueError("refused")
            size = 0
            while chunk := resp.read1(CHUNK):  # what one receive brings: the deadline holds for a trickle
                size += len(chunk)
                if size > MAX_BYTES or time.monotonic() > deadline:
                    raise ValueError("too large or too slow")
                out.write(chunk)
        return partial
    except (OSError, ValueError, http.client.HTTPException):  # HTTPError and timeouts are OSErrors
        os.unlink(partial)
        return None


def _private_folder(folder: Path, *, create: bool) -> bool:
    """Whether `folder` is a real folder of this user's that no one else may write
    (made, 0700, where `create`)."""
    if create:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return False
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
