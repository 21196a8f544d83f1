"""Fetch one listing's objects into a directory and check them against the listing.

boto3's transfer manager streams each object to disk in chunks, so memory stays bounded whatever
the file's size, and splits a file above the part size into parallel ranged GETs. It checks that
the object did not change between its first and last range; the checks here compare what landed
on disk with the listing the cache entry is named after.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuworkers.weights import WeightsUnavailableError
from gpuworkers.weights.client import weights_error
from gpuworkers.weights.listing import WeightListing, WeightObject

# A plain single-part upload's ETag is the MD5 of its bytes; a multipart one ends in "-<parts>".
_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
_HASH_CHUNK_BYTES = 1024 * 1024


def fetch_listing(client: Any, listing: WeightListing, into: Path, *, part_bytes: int, concurrency: int) -> None:
    """Download every object of ``listing`` under ``into``; raise if one is missing, short or corrupt."""
    # Imported here, as the client is: boto3 costs every slot process ~0.2 s at start.
    from boto3.exceptions import Boto3Error
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(
        multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=concurrency, use_threads=True
    )
    for item in listing.objects:
        target = into / item.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            client.download_file(listing.bucket, item.key, str(target), Config=config)
            _check(client, listing, item, target)
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            raise weights_error(exc, listing.source, f"downloading {item.path}") from exc


def _check(client: Any, listing: WeightListing, item: WeightObject, target: Path) -> None:
    size = target.stat().st_size
    if size != item.size:
        raise WeightsUnavailableError(
            f"model source {listing.source!r}: {item.path} has {size} bytes, listed {item.size}"
        )
    if _MD5_ETAG.fullmatch(item.etag) and _md5(target) != item.etag and not _encrypted(client, listing, item):
        raise WeightsUnavailableError(f"model source {listing.source!r}: {item.path} does not match its MD5 ETag")
    # Written before the entry is renamed into place and its marker written, so a crash never leaves
    # a marked entry whose bytes are still only in the page cache.
    with target.open("rb") as handle:
        os.fsync(handle.fileno())


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _encrypted(client: Any, listing: WeightListing, item: WeightObject) -> bool:
    # With SSE-KMS or SSE-C the ETag looks like an MD5 but is not one; only then is a mismatch no error.
    head = client.head_object(Bucket=listing.bucket, Key=item.key)
    return head.get("ServerSideEncryption", "").startswith("aws:kms") or "SSECustomerAlgorithm" in head
