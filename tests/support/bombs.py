"""Decompression bombs: a few hundred KB of gzip or zstd that expand to hundreds of MB, built a MiB at
a time so that the test itself never holds what they expand to."""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from pathlib import Path

import zstandard

MiB = 1024 * 1024
LINE = b'{"input": "' + b"a" * 4000 + b'"}\n'
BOMB_BYTES = 300 * MiB
"""What each bomb decompresses to; its compressed form is a few hundred KB (gzip) or less (zstd)."""


def _chunks(first: bytes, filler: bytes, total: int) -> Iterator[bytes]:
    yield first
    left = total - len(first)
    block = filler * (MiB // len(filler))
    while left > 0:
        yield block[:left]
        left -= len(block)


def gzip_bomb(first: bytes = b"", filler: bytes = LINE, total: int = BOMB_BYTES) -> bytes:
    """gzip of `total` bytes, `first` and then `filler` repeated, compressed a MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip header and trailer
    out = [packer.compress(chunk) for chunk in _chunks(first, filler, total)]
    return b"".join([*out, packer.flush()])


def zstd_bomb(filler: bytes = LINE, total: int = BOMB_BYTES) -> bytes:
    sink = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(sink, closefd=False) as writer:
        for chunk in _chunks(b"", filler, total):
            writer.write(chunk)
    return sink.getvalue()


def written_bytes() -> int:
    """Bytes this process has handed to write(2) so far, files and pipes alike (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")
