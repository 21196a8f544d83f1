"""Picks the backend for a URI by its scheme."""

from __future__ import annotations

from urllib.parse import urlparse

from tasks.storage.base import ObjectStore, StorageError
from tasks.storage.local import LocalStore

_LOCAL = LocalStore()


def store_for(uri: str) -> ObjectStore:
    scheme = urlparse(uri).scheme
    if scheme == "file":
        return _LOCAL
    raise StorageError(f"unsupported storage URI scheme {scheme!r} in {uri} (supported: file://)")
