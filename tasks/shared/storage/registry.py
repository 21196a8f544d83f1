"""Picks the backend for a URI by its scheme."""

from __future__ import annotations

from typing import BinaryIO
from urllib.parse import urlparse

from tasks.shared.storage.base import ObjectStore, StorageError
from tasks.shared.storage.local import LocalStore
from tasks.shared.storage.s3 import S3Store

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


def input_open(uri: str) -> BinaryIO:
    """Open a job's input for reading: a `file://` one without following any symbolic link (its path
    was resolved and checked at submission, see `LocalStore.open_read_no_symlinks`)."""
    if urlparse(uri).scheme == "file":
        return _LOCAL.open_read_no_symlinks(uri)
    return store_for(uri).open_read(uri)


def presigned_url(uri: str, *, expires_s: int) -> str | None:
    """A URL that downloads the object without credentials for `expires_s`, where the backend can
    sign one (S3); None otherwise (`file://`), and the caller serves the bytes itself."""
    presign = getattr(store_for(uri), "presigned_get", None)
    return str(presign(uri, expires_s=expires_s)) if presign is not None else None
