"""What an ``s3://bucket/prefix/`` source holds now, named by a digest of its content.

The digest covers each object's key relative to the prefix, its size and its ETag, so a new upload
under the same prefix is a new cache entry and an unchanged prefix is the same entry on every host.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.weights.client import weights_error

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class WeightObject:
    """One file of a model directory in the store."""

    key: str
    """The object's full key."""
    path: str
    """Its path relative to the prefix, with ``/`` separators; where it lands in the entry."""
    size: int
    etag: str
    """The ETag without quotes: the MD5 of the bytes for a plain single-part upload."""


@dataclass(frozen=True)
class WeightListing:
    """The objects under one source's prefix at one moment."""

    source: str
    bucket: str
    objects: tuple[WeightObject, ...]
    """Sorted by path."""

    @cached_property
    def digest(self) -> str:
        content = [[item.path, item.size, item.etag] for item in self.objects]
        return hashlib.sha256(json.dumps(content, separators=(",", ":")).encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(item.size for item in self.objects)


def parse_source(source: str) -> tuple[str, str]:
    """The bucket and the folder prefix (``""`` or ending in ``/``) of ``s3://bucket/prefix/``."""
    bucket, _, key = source.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise EngineLoadError(f"model source {source!r} does not name a valid S3 bucket (s3://bucket/prefix/)")
    # A prefix names a folder: s3://b/models/m covers models/m/..., never models/m2/...
    return bucket, f"{key.strip('/')}/" if key.strip("/") else ""


def list_source(client: Any, source: str) -> WeightListing:
    """The listing of ``source``; EngineLoadError when it holds no files or a path that would leave the entry."""
    bucket, prefix = parse_source(source)
    objects = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                key = item["Key"]
                # Zero-byte "folder" markers made by consoles and tools are not files of the model.
                if key.endswith("/"):
                    continue
                path = key[len(prefix) :]
                _check_path(source, path)
                objects.append(WeightObject(key=key, path=path, size=int(item["Size"]), etag=item["ETag"].strip('"')))
    except (ClientError, BotoCoreError) as exc:
        raise weights_error(exc, source, "listing") from exc
    if not objects:
        raise EngineLoadError(f"model source {source!r}: no objects under s3://{bucket}/{prefix}")
    return WeightListing(source=source, bucket=bucket, objects=tuple(sorted(objects, key=lambda item: item.path)))


def _check_path(source: str, path: str) -> None:
    # Split by hand: pathlib would quietly drop the "." and empty parts this refuses.
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise EngineLoadError(f"model source {source!r}: object path {path!r} would land outside the model directory")
