"""Compressed job inputs: gzip and zstd found by their magic bytes or the file's name, read as a stream.

The first bytes of an input decide its compression (and, for Parquet, its format), so `peek` reads
them and hands back a stream that still starts with them, whether or not the source can seek.

Every decompressed stream is bounded (`DecompressionLimits`): a few hundred KB of gzip or zstd may
expand into gigabytes, so reading stops with `DecompressionLimitExceeded`, naming the limit and its
setting, once the output passes its most bytes or, past a first `ratio_after` bytes (so that a small
file of repeated lines is not refused), grows more than `max_ratio` times the compressed bytes read.
No reader (the submission's check, the dry run, the planner, a Parquet spill) gets past it.
"""

from __future__ import annotations

import gzip
import io
import zlib
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, BinaryIO, cast

import zstandard

from tasks.shared.config import MAX_COMPRESSION_RATIO, MAX_DECOMPRESSED_BYTES

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


RATIO_AFTER_BYTES = 64 * 1024 * 1024
"""Decompressed bytes read before the ratio applies: a small file of repeated lines may well compress
a thousand times, and 64 MiB is what a bomb may cost before the ratio stops it."""


class DecompressionLimitExceeded(ValueError):
    """A compressed input expands past a limit: `limit` is its value, `setting` what sets it."""

    def __init__(self, message: str, *, limit: float, setting: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.setting = setting


@dataclass(frozen=True)
class DecompressionLimits:
    """How far a compressed input may expand as it is read."""

    max_bytes: int
    """The most decompressed bytes."""
    max_ratio: float
    """The most decompressed bytes per compressed byte read, once `ratio_after` bytes are out."""
    ratio_after: int = RATIO_AFTER_BYTES
    bytes_setting: str = MAX_DECOMPRESSED_BYTES.name
    """What sets `max_bytes`, named by the refusal: the operator's setting, or a tenant's quota."""

    @classmethod
    def configured(cls) -> DecompressionLimits:
        """The operator's limits (BATCHERY_MAX_DECOMPRESSED_BYTES, BATCHERY_MAX_COMPRESSION_RATIO)."""
        return cls(max_bytes=MAX_DECOMPRESSED_BYTES.read(), max_ratio=MAX_COMPRESSION_RATIO.read())

    def capped(self, max_bytes: int | None, *, setting: str) -> DecompressionLimits:
        """These limits with `max_bytes` lowered to `max_bytes` (a quota, named `setting`) where that is lower."""
        if max_bytes is None or max_bytes >= self.max_bytes:
            return self
        return DecompressionLimits(
            max_bytes=max_bytes, max_ratio=self.max_ratio, ratio_after=self.ratio_after, bytes_setting=setting
        )


def decompressed(
    stream: IO[bytes], compression: str | None, head: bytes, limits: DecompressionLimits | None = None
) -> IO[bytes]:
    """`stream` decompressed as `compression` says, bounded by `limits` (by default the operator's);
    an uncompressed stream is returned as it is."""
    if compression is None:
        return stream
    source = _Counted(stream)
    plain: IO[bytes]
    if compression == "gzip":
        plain = cast("IO[bytes]", gzip.GzipFile(fileobj=source, mode="rb"))  # typeshed's GzipFile is no IO
    else:
        plain = io.BufferedReader(_ZstdReader(cast("IO[bytes]", source), head))
    return io.BufferedReader(_Bounded(plain, source, limits or DecompressionLimits.configured()))


class _Counted(io.RawIOBase):
    """A compressed stream that counts the bytes read from it, for the ratio."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._raw.read(len(view))
        view[: len(data)] = data
        self.count += len(data)
        return len(data)


class _Bounded(io.RawIOBase):
    """A decompressed stream that raises `DecompressionLimitExceeded` once it passes `limits`; it never
    hands out more than one byte over `max_bytes`, so no caller holds or writes more than that."""

    def __init__(self, plain: IO[bytes], source: _Counted, limits: DecompressionLimits) -> None:
        super().__init__()
        self._plain = plain
        self._source = source
        self._limits = limits
        self.produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        limits = self._limits
        view = memoryview(buffer).cast("B")
        room = limits.max_bytes + 1 - self.produced
        data = self._plain.read(min(len(view), room))
        view[: len(data)] = data
        self.produced += len(data)
        # The ratio first: a bomb is named as one even where a size limit falls at the same point.
        consumed = max(self._source.count, 1)
        if self.produced >= limits.ratio_after and self.produced > limits.max_ratio * consumed:
            raise DecompressionLimitExceeded(
                f"the input expands more than {limits.max_ratio:g} times as it decompresses "
                f"({self.produced} bytes from {self._source.count}), the limit "
                f"{MAX_COMPRESSION_RATIO.name} sets",
                limit=limits.max_ratio,
                setting=MAX_COMPRESSION_RATIO.name,
            )
        if self.produced > limits.max_bytes:
            raise DecompressionLimitExceeded(
                f"the input decompresses to more than {limits.max_bytes} bytes, the limit {limits.bytes_setting} sets",
                limit=limits.max_bytes,
                setting=limits.bytes_setting,
            )
        return len(data)


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
