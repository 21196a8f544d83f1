"""Compressed job inputs: gzip and zstd found by their magic bytes or the file's name, read as a stream.

The first bytes of an input decide its compression (and, for Parquet, its format), so `peek` reads
them and hands back a stream that still starts with them, whether or not the source can seek.
"""

from __future__ import annotations

import gzip
import io
import zlib
from typing import IO, TYPE_CHECKING, BinaryIO, cast

import zstandard

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

HEAD_BYTES = 32  # the magic bytes, and a whole zstd frame header (at most 18 bytes)
COMPRESSION_SUFFIXES = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}
CORRUPT = (gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError)
"""What reading a damaged compressed stream raises."""

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def sniffed_compression(head: bytes) -> str | None:
    """The compression the input's first bytes announce, if any."""
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_ZSTD_MAGIC):
        return "zstd"
    return None


def peek(raw: BinaryIO) -> tuple[bytes, IO[bytes]]:
    """The first bytes of `raw`, and a stream that still starts with them."""
    if raw.seekable():
        start = raw.tell()
        head = raw.read(HEAD_BYTES)
        raw.seek(start)
        return head, raw
    head = b""
    while len(head) < HEAD_BYTES and (chunk := raw.read(HEAD_BYTES - len(head))):
        head += chunk
    return head, io.BufferedReader(_Prefixed(head, raw))


class _Prefixed(io.RawIOBase):
    """`head`, then the rest of `rest`: a stream that cannot seek, with its first bytes put back."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        super().__init__()
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        if self._head:
            size = min(len(view), len(self._head))
            view[:size] = self._head[:size]
            self._head = self._head[size:]
            return size
        data = self._rest.read(len(view))
        view[: len(data)] = data
        return len(data)


def decompressed(stream: IO[bytes], compression: str | None, head: bytes) -> IO[bytes]:
    if compression == "gzip":
        return cast("IO[bytes]", gzip.GzipFile(fileobj=stream, mode="rb"))  # typeshed's GzipFile is no IO
    if compression == "zstd":
        return io.BufferedReader(_ZstdReader(stream, head))
    return stream


class _ZstdReader(io.RawIOBase):
    """zstd decompression, streaming, that notices an input cut short inside its first frame.

    zstandard's reader ends quietly where its input ends, even inside a frame. When the first frame
    records its size (the zstd tool records it for files), a shorter output is reported as truncated.
    """

    def __init__(self, source: IO[bytes], head: bytes) -> None:
        super().__init__()
        self._reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True, closefd=False)
        try:
            size = zstandard.get_frame_parameters(head).content_size
        except zstandard.ZstdError:
            size = 0
        self._expected = 0 if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) else size
        self._produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        size: int = self._reader.readinto(buffer)
        self._produced += size
        if size == 0 and self._produced < self._expected:
            raise zstandard.ZstdError(f"input ends after {self._produced} of the {self._expected} bytes of a frame")
        return size


def corrupt_message(exc: Exception) -> str:
    return f"the compressed input is corrupt, reading stops here ({exc or type(exc).__name__})"
