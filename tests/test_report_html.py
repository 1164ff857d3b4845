"""The HTML report: one self-contained file, and what a browser actually draws of it."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from synth import healthy, input_pipeline
from trainbpf.reports.render import run_analyze
from test_analyze_chains import chain_trace


def _self_contained(html: str) -> None:
    assert html.startswith("<!DOCTYPE html>")
    assert "<script" not in html.lower()
    assert "<link" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.I)
    assert "@import" not in html and "url(" not in html
    # The only URL is the SVG namespace, which nothing fetches.
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}


def test_html_report_content(tmp_path):
    out = tmp_path / "r.html"
    html = run_analyze(path=chain_trace([200, 300]).write(tmp_path / "t.parquet"), fmt="html", output=out)
    assert out.read_text() == html
    _self_contained(html)
    assert html.count("<svg") == 2  # timeline and per-thread bars
    assert "GPU-starvation timeline" in html
    assert "dirty_throttling" in html and "critical" in html
    assert "trainer 100 [futex] ← dataloader 200 [sleep] ← checkpoint 300 [dirty_throttling]" in html
    assert "dirty_pause_events" in html  # evidence table
    assert "What to do:" in html


def test_timeline_draws_utilisation_and_the_stalls_under_it(tmp_path):
    """The GPU lane: the utilisation as a line, and the idle time the trainer's stalls
    explain hanging above it in the cause's colour, column by column (partial idleness
    at step scale)."""
    html = run_analyze(path=input_pipeline().write(tmp_path / "t.parquet"), fmt="html")
    lane = html[html.index(">GPU utilisation<"):html.index(">trainer state<")]
    assert "<polyline" in lane
    explained = re.findall(r'<rect x="[\d.]+" y="[\d.]+" width="[\d.]+" height="([\d.]+)" fill="#1f77b4"', lane)
    assert len(explained) > 100  # input_pipeline's colour, in most of the 400 columns
    heights = np.array(explained, float)
    assert ((heights > 0) & (heights < 110)).any()  # columns partly explained, not all or nothing
    assert "idle 71.5% of the time (1 - mean utilisation)" in html


def test_html_report_no_gpu_and_empty(tmp_path):
    html = run_analyze(path=healthy(gpu=False).write(tmp_path / "t.parquet"), fmt="html")
    _self_contained(html)
    assert "No GPU samples in this trace: starved time is the trainer's non-running time" in html
    from synth import Synth

    html = run_analyze(path=Synth(duration_s=3.0).write(tmp_path / "e.parquet"), fmt="html")
    _self_contained(html)
    assert "This trace holds no thread activity" in html


def test_html_escapes_names(tmp_path):
    s = input_pipeline()
    s.thread(300, "<b>evil&</b>")
    html = run_analyze(path=s.write(tmp_path / "t.parquet"), fmt="html")
    assert "<b>evil" not in html
    assert "&lt;b&gt;evil&amp;" in html


def read_png(path: Path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) into an (h, w, 3) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.uint8)
    prev = np.zeros(width * bpp, dtype=np.uint8)
    for y in range(height):  # undo each row's PNG filter
        kind, line = int(raw[y, 0]), raw[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # Sub: running sum along the row, per channel
            cur = (np.cumsum(line.reshape(width, bpp).astype(np.int64), axis=0) % 256).astype(np.uint8).ravel()
        elif kind == 2:  # Up
            cur = line + prev
        else:  # Average / Paeth depend on the decoded left byte: plain Python per byte
            cur_l, up, src = [0] * len(line), prev.tolist(), line.tolist()
            for x in range(len(src)):
                left = cur_l[x - bpp] if x >= bpp else 0
                if kind == 3:
                    pred = (left + up[x]) >> 1
                else:
                    up_left = up[x - bpp] if x >= bpp else 0
                    p = left + up[x] - up_left
                    pa, pb, pc = abs(p - left), abs(p - up[x]), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else (up[x] if pb <= pc else up_left)
                cur_l[x] = (src[x] + pred) & 0xFF
            cur = np.array(cur_l, dtype=np.uint8)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "headless_shell"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_html_report_renders_in_headless_chromium(tmp_path):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is required in CI to render the HTML report (apt-get install -y chromium)")
        pytest.skip("chromium is not installed: cannot check that the HTML report renders (apt-get install -y chromium)")
    report = tmp_path / "report.html"
    run_analyze(path=chain_trace([200, 300]).write(tmp_path / "t.parquet"), fmt="html", output=report)
    shot = tmp_path / "shot.png"
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1400,1000",
        report.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot; chromium said: {proc.stderr[-2000:]}"
    keep = os.environ.get("TRAINBPF_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    pixels = read_png(shot)
    assert pixels.shape[:2] == (1000, 1400)
    not_white = (pixels < 235).any(axis=2)
    assert not_white.mean() > 0.03, "the page looks blank"
    colours = np.unique(pixels.reshape(-1, 3)[::7], axis=0)
    assert len(colours) > 50, "too few colours for a timeline, bars and text"
    # The timeline's upper part: the starved time hanging in the GPU lane in the top
    # cause's colour (dirty_throttling #e8702a at 75% over the lane's #fafafa).
    top = pixels[100:500].astype(int)
    orange = (top[:, :, 0] > 220) & (top[:, :, 1] > 125) & (top[:, :, 1] < 170) & (top[:, :, 2] < 130)
    assert orange.any(), "no starved time drawn in the top cause's colour"
