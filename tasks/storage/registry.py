"""Picks the backend for a URI by its scheme."""

from __future__ import annotations

from urllib.parse import urlparse

from tasks.storage.base import ObjectStore, StorageError
from tasks.storage.local import LocalStore
from tasks.storage.s3 import S3Store

_LOCAL = LocalStore()
# One per process: it holds the S3 client and its connection pool, made on first use.
_S3 = S3Store()


def store_for(uri: str) -> ObjectStore:
    scheme = urlparse(uri).scheme
    if scheme == "file":
        return _LOCAL
    if scheme == "s3":
        return _S3
    raise StorageError(f"unsupported storage URI scheme {scheme!r} in {uri} (supported: file://, s3://)")
