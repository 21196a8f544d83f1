"""The `ObjectStore` protocol and the errors every backend raises."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO, Protocol


class StorageError(Exception):
    """A storage operation failed for good (missing object, permission denied)."""


class TransientStorageError(StorageError):
    """A storage operation failed in a way that a retry may fix (throttling, lost connection)."""


class ObjectStore(Protocol):
    def open_read(self, uri: str) -> BinaryIO:
        """A streaming binary reader; raises StorageError if the object does not exist."""

    def open_write(self, uri: str) -> AbstractContextManager[BinaryIO]:
        """A binary writer; the object appears, whole, only when the block exits without error."""

    def put_if_absent(self, uri: str, data: bytes) -> bool:
        """Create the object unless it exists; True if this call created it (first writer wins)."""

    def read_bytes(self, uri: str) -> bytes: ...

    def exists(self, uri: str) -> bool: ...

    def size(self, uri: str) -> int: ...

    def list_prefix(self, uri: str) -> Iterator[str]:
        """URIs of the objects under a prefix, in key order."""

    def delete_prefix(self, uri: str) -> None:
        """Delete every object under a prefix; a missing prefix is not an error."""

    def prefix_bytes(self, uri: str) -> int:
        """Bytes of the objects under a prefix (0 for none), from listings, not reads."""


def join_uri(base: str, *parts: str) -> str:
    """Join URI path segments with single slashes."""
    joined = base.rstrip("/")
    for part in parts:
        joined = f"{joined}/{part.strip('/')}"
    return joined
