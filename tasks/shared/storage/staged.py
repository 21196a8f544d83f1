"""Staged objects: appended to by successive processes, published whole only at the end.

The merge stitches a job's shard outputs as the shards finish, in separate control tasks, into an
object nobody may see before the job ends. The caller keeps a `StagedState` (JSON, beside the job's
other objects) and passes it back on each append:

- `file://`: a hidden file beside the target (hidden names are not listed), cut back to the size the
  state records before each append, so an append that died half-way is undone; renamed into place.
- `s3://`: a multipart upload of the target key, one part per append of at least 5 MiB (S3's minimum
  for every part but the last; a smaller append is declined and the caller offers it again, grown);
  S3 shows nothing until the upload completes, and an aborted one leaves nothing.

An append whose state no longer matches the store (the staged file is gone, the upload was completed
or aborted) raises `StagedLost`: the caller starts again from the beginning.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from botocore.exceptions import BotoCoreError, ClientError

from tasks.shared.storage.base import StorageError
from tasks.shared.storage.local import path_of
from tasks.shared.storage.registry import store_for
from tasks.shared.storage.s3 import MAX_PARTS, MIN_PART_BYTES, S3Store, _error_code, _object_of, _storage_error

SPOOL_BYTES = 64 * 1024 * 1024  # an S3 part is spooled in memory up to this size, then on disk

Writer = Callable[[BinaryIO], None]


class StagedLost(StorageError):
    """The staged object is not what its state says: finished, aborted or deleted meanwhile."""


@dataclass
class StagedState:
    size: int = 0
    """Bytes staged so far."""
    upload_id: str = ""
    """s3://: the multipart upload holding the staged parts; empty before the first part."""
    parts: list[dict[str, Any]] = field(default_factory=list)
    """s3://: the parts uploaded, as `complete_multipart_upload` wants them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagedState:
        return cls(**data)


def _staged_path(uri: str) -> Path:
    path = path_of(uri)
    return path.with_name(f".{path.name}.staged")


def _append_local(uri: str, state: StagedState, write: Writer) -> StagedState:
    path = _staged_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    if state.size and (not path.exists() or path.stat().st_size < state.size):
        raise StagedLost(f"the staged copy of {uri} is gone")
    with path.open("r+b" if path.exists() else "w+b") as handle:
        handle.truncate(state.size)
        handle.seek(state.size)
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
        return StagedState(size=handle.tell())


class _S3Staging:
    def __init__(self, store: S3Store, uri: str) -> None:
        self.uri = uri
        self.bucket, self.key = _object_of(uri)
        # The store's own client (one per process); the staging is part of the backend.
        self.client = store._client()
        checksums = self.client.meta.config.request_checksum_calculation == "when_supported"
        self.checksum_args = {"ChecksumAlgorithm": "CRC32"} if checksums else {}

    def append(self, state: StagedState, write: Writer, *, last: bool) -> StagedState | None:
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            write(spool)  # type: ignore[arg-type]
            length = spool.tell()
            # Every part but the last must hold 5 MiB, and one slot is kept for the last.
            if not last and (length < MIN_PART_BYTES or len(state.parts) >= MAX_PARTS - 1):
                return None
            if length == 0:
                return state
            spool.seek(0)
            with _staging_errors(self.uri):
                upload_id = state.upload_id
                if not upload_id:
                    created = self.client.create_multipart_upload(
                        Bucket=self.bucket, Key=self.key, **self.checksum_args
                    )
                    upload_id = created["UploadId"]
                number = len(state.parts) + 1
                response = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=spool,
                    **self.checksum_args,
                )
        part = {"PartNumber": number, "ETag": response["ETag"]}
        if "ChecksumCRC32" in response:
            part["ChecksumCRC32"] = response["ChecksumCRC32"]
        return StagedState(size=state.size + length, upload_id=upload_id, parts=[*state.parts, part])

    def complete(self, state: StagedState) -> None:
        with _staging_errors(self.uri):
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=self.key, UploadId=state.upload_id, MultipartUpload={"Parts": state.parts}
            )

    def abort(self, state: StagedState) -> None:
        try:
            with _staging_errors(self.uri):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=state.upload_id)
        except StagedLost:
            return  # completed or aborted already


@contextmanager
def _staging_errors(uri: str) -> Iterator[None]:
    """An upload not as its state says as `StagedLost`; every other failure as the store classes it."""
    try:
        yield
    except ClientError as exc:
        # No upload (completed or aborted), or parts that are not the ones recorded (two stagers raced).
        if _error_code(exc)[0] in ("NoSuchUpload", "InvalidPart", "InvalidPartOrder"):
            raise StagedLost(f"the multipart upload staging {uri} is gone or not as recorded") from exc
        raise _storage_error(exc, uri, "staging") from exc
    except BotoCoreError as exc:
        raise _storage_error(exc, uri, "staging") from exc


def staged_min_bytes(uri: str) -> int:
    """The least an append to a staged `uri` must hold to be taken (all but the last)."""
    return MIN_PART_BYTES if isinstance(store_for(uri), S3Store) else 0


def staged_append(uri: str, state: StagedState, write: Writer) -> StagedState | None:
    """Append what `write` writes to the object staged for `uri`; the new state, or None when the
    store declines an append this small (S3) and nothing was staged."""
    store = store_for(uri)
    if isinstance(store, S3Store):
        return _S3Staging(store, uri).append(state, write, last=False)
    return _append_local(uri, state, write)


def staged_publish(uri: str, state: StagedState, write: Writer) -> None:
    """Append the last bytes and make the staged object appear, whole, at `uri`."""
    store = store_for(uri)
    if not state.size:
        # Nothing staged: an ordinary write (and a file:// append that died before its first byte counted is dropped).
        with store.open_write(uri) as handle:
            write(handle)
        staged_discard(uri, state)
        return
    if isinstance(store, S3Store):
        staging = _S3Staging(store, uri)
        final = staging.append(state, write, last=True)
        assert final is not None  # the last part is never declined
        staging.complete(final)
        return
    _append_local(uri, state, write)
    os.replace(_staged_path(uri), path_of(uri))


def staged_discard(uri: str, state: StagedState) -> None:
    """Drop the staged object; `uri` is left as it was."""
    store = store_for(uri)
    if isinstance(store, S3Store):
        if state.upload_id:
            _S3Staging(store, uri).abort(state)
        return
    _staged_path(uri).unlink(missing_ok=True)
