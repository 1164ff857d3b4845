"""Debug files fetched from debuginfod servers (tracer/symbols/debuginfod.py, issue 29 item
5): a real HTTP server on 127.0.0.1 serves libc's debug file (Debian's libc6-dbg) by
build-id, while the local lookup is pointed at an empty folder, so only the server can
name glibc's main_arena.  A server that fails leaves the address as mapping+offset."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kernel_env import missing
from test_addrs import describe
from trainbpf.tracer.symbols import debuginfod, elf
from trainbpf.tracer.symbols.elf import FUNCTION_KINDS, OBJECT_KINDS, ElfSymbols, debug_file, symbol_tables
from trainbpf.tracer.symbols.maps import parse_maps


def _libc() -> tuple[str, int, ElfSymbols]:
    """libc's path, the base it is mapped at here, and its own symbols."""
    with open("/proc/self/maps") as fh:
        maps = parse_maps(fh.read())
    path = next(m.path for m in maps if os.path.basename(m.path).startswith("libc.so"))
    return path, min(m.start - m.offset for m in maps if m.path == path), ElfSymbols(path)


@pytest.fixture
def libc(tmp_path, monkeypatch):
    """(path, main_arena's address here and in the file, the debug file's bytes, the
    build-id), with the local debug root empty and the cache in tmp_path."""
    path, base, own = _libc()
    local = debug_file(path, own)
    if local is None:
        missing("libc's debug symbols are not installed (Debian package libc6-dbg; scripts/setup.sh installs it)")
    linked = ElfSymbols(local).address_of("main_arena")
    (tmp_path / "debug").mkdir()
    monkeypatch.setattr(elf, "DEBUG_ROOT", str(tmp_path / "debug"))
    monkeypatch.setattr(debuginfod, "CACHE", tmp_path / "cache")
    monkeypatch.delenv(debuginfod.URLS_VARIABLE, raising=False)
    assert debug_file(path, own) is None, "the local lookup still finds it"
    return path, base + linked - own.first_vaddr, linked, Path(local).read_bytes(), own.build_id


class Server:
    """A debuginfod server on 127.0.0.1: answers every GET with `status` and `body`
    (with a Content-Length unless `length` is False), and records the paths asked."""

    def __init__(self, status: int, body: bytes, length: bool = True):
        self.asked: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.asked.append(self.path)
                self.send_response(status)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    started = []

    def start(*args, **kwargs) -> Server:
        started.append(Server(*args, **kwargs))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_a_stripped_librarys_symbol_is_named_from_the_fetched_debug_file(libc, serve, monkeypatch):
    path, arena, _, debug, build_id = libc
    server = serve(200, debug)
    monkeypatch.setenv(debuginfod.URLS_VARIABLE, f"ftp://127.0.0.1/ {server.url}/")
    assert describe(arena) == [("image", f"main_arena+0x0 [{os.path.basename(path)}]")]
    assert server.asked == [f"/buildid/{build_id}/debuginfo"]
    kept = debuginfod.CACHE / f"{build_id}.debug"
    assert kept.read_bytes() == debug and os.stat(debuginfod.CACHE).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(debuginfod.CACHE)) == [kept.name], "no partial download left"
    assert describe(arena) == [("image", f"main_arena+0x0 [{os.path.basename(path)}]")]
    assert len(server.asked) == 1, "a second lookup is served from the cache"


@pytest.mark.parametrize("answer", ["404", "garbage", "another ELF file", "too large", "too large, unannounced"])
def test_a_server_that_fails_leaves_the_address_unnamed(libc, serve, monkeypatch, answer):
    path, arena, linked, debug, build_id = libc
    monkeypatch.setattr(debuginfod, "MAX_BYTES", len(debug) - 1 if answer.startswith("too large") else debuginfod.MAX_BYTES)
    status, body = {"404": (404, b"not found"), "garbage": (200, os.urandom(65536)),
                    "another ELF file": (200, Path("/bin/ls").read_bytes())}.get(answer, (200, debug))
    server = serve(status, body, length=answer != "too large, unannounced")
    monkeypatch.setenv(debuginfod.URLS_VARIABLE, server.url)
    ((state, name),) = describe(arena)
    assert (state, name) == ("image", f"{os.path.basename(path)}+0x{linked:x}")
    assert server.asked == [f"/buildid/{build_id}/debuginfo"]
    assert os.listdir(debuginfod.CACHE) == [], "nothing kept, no partial download left"
    assert len(symbol_tables(path, path, OBJECT_KINDS, fetch=True)) == 1 and len(server.asked) == 1, \
        "a failed build-id is asked once"


def test_nothing_is_fetched_unless_the_user_names_a_server(libc, serve, monkeypatch):
    path, arena, _, debug, _ = libc
    server = serve(200, debug)
    ((state, name),) = describe(arena)
    assert name.startswith(f"{os.path.basename(path)}+0x") and server.asked == []
    assert not debuginfod.CACHE.exists()
    # nor for a stack's functions: every library of every stack, at each flush
    monkeypatch.setenv(debuginfod.URLS_VARIABLE, server.url)
    assert len(symbol_tables(path, path, FUNCTION_KINDS, every_table=True)) == 1 and server.asked == []
