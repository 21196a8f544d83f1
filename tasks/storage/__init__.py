"""Object storage behind one small interface, chosen by URI scheme (`file://` now, `s3://` later).

Everything a shard reads or writes is addressed by a full URI, so a GPU host needs only the URI
and credentials for the store, never the database.
"""

from __future__ import annotations

from tasks.storage.base import ObjectStore, StorageError, TransientStorageError, join_uri
from tasks.storage.registry import store_for

__all__ = ["ObjectStore", "StorageError", "TransientStorageError", "join_uri", "store_for"]
