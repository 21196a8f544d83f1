"""Object storage behind one small interface, chosen by URI scheme (`file://`, `s3://`).

Everything a shard reads or writes is addressed by a full URI, so a GPU host needs only the URI
and credentials for the store, never the database.
"""

from __future__ import annotations

from tasks.shared.storage.base import ObjectStore, StorageError, TransientStorageError, join_uri
from tasks.shared.storage.registry import input_open, presigned_url, store_for
from tasks.shared.storage.s3 import S3Store

__all__ = [
    "ObjectStore",
    "S3Store",
    "StorageError",
    "TransientStorageError",
    "input_open",
    "join_uri",
    "presigned_url",
    "store_for",
]
