"""`s3://bucket/key` storage: objects in Amazon S3 or any S3-compatible store (MinIO, Ceph, moto).

The client follows boto3's standard configuration: credentials, region and endpoint come from the
environment (`AWS_ACCESS_KEY_ID`, `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_S3`, ...)
or the shared AWS config files. A custom endpoint is addressed path-style (`host/bucket/key`).
`BATCHERY_S3_MAX_ATTEMPTS` (total attempts per request, default 5) and `BATCHERY_S3_PART_BYTES`
(multipart part size, default 16 MiB, at least 5 MiB) tune it.

Keys are taken literally from the URI (no percent-decoding), and a prefix names a "folder": listing
or deleting `s3://b/jobs/1` covers `jobs/1/...`, never `jobs/10/...`, as `file://` does.

Writes stream in parts: an object smaller than one part is sent with a single PUT, a larger one as
a multipart upload that is completed only when the writer's block exits without error, and
aborted otherwise, so readers never see half an object. An upload whose abort itself fails (the
process died, S3 unreachable) lingers invisibly; a bucket lifecycle rule with
`AbortIncompleteMultipartUpload` cleans those up.
"""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, BinaryIO

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from gpuworkers.weights.client import S3Clients
from tasks.shared.config import S3_MIN_PART_BYTES, S3_PART_BYTES
from tasks.shared.storage.base import StorageError, TransientStorageError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

logger = logging.getLogger(__name__)

MIN_PART_BYTES = S3_MIN_PART_BYTES
MAX_PARTS = 10_000  # S3's maximum number of parts in one upload
_READ_BUFFER_BYTES = 1024 * 1024
_WRITE_BUFFER_BYTES = 256 * 1024
_CONFLICT_ATTEMPTS = 5
_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED_CODES = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "503",
}
_TRANSIENT_STATUSES = {500, 502, 503, 504}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """The bucket and key (possibly empty, for a prefix) of `s3://bucket/key`: the key is every character after
    the bucket's `/`, `?` and `#` included, as every operation of the store sends it. The one reading of an
    S3 URI: checks of where a URI may point (`portal.jobs.services.input_access`) compare this key.

    A key with a `.` or `..` segment is refused: the HTTP client resolves them in the request's path, so the
    object read would not be the key named (`root/x?/../../other` reads `other`)."""
    if not uri.startswith("s3://"):
        raise StorageError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise StorageError(f"{uri} does not name a valid S3 bucket (expected s3://bucket/key)")
    if any(segment in (".", "..") for segment in key.split("/")):
        raise StorageError(f"{uri} has a '.' or '..' segment in its key; name the object's key as it is")
    return bucket, key


def _object_of(uri: str) -> tuple[str, str]:
    bucket, key = parse_s3_uri(uri)
    if not key or key.endswith("/"):
        raise StorageError(f"{uri} names no object (expected s3://bucket/key)")
    return bucket, key


def _folder(key: str) -> str:
    return f"{key.rstrip('/')}/" if key.strip("/") else ""


def _error_code(exc: ClientError) -> tuple[str, int | None]:
    code = str(exc.response.get("Error", {}).get("Code", "Unknown"))
    return code, exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _storage_error(exc: Exception, uri: str, action: str) -> StorageError:
    """The one place that decides which S3 failures a retry may fix."""
    if isinstance(exc, ClientError):
        code, status = _error_code(exc)
        if code == "NoSuchBucket":
            return StorageError(f"no such bucket while {action} {uri} (S3 {code})")
        if code in _MISSING_CODES or status == 404:
            return StorageError(f"no such object: {uri} (S3 {code} while {action})")
        if code in _DENIED_CODES or status == 403:
            return StorageError(f"permission denied while {action} {uri} (S3 {code})")
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUSES:
            return TransientStorageError(f"S3 unavailable while {action} {uri} (S3 {code}, HTTP {status})")
        message = exc.response.get("Error", {}).get("Message", "")
        return StorageError(f"S3 refused {action} {uri} (S3 {code}, HTTP {status}): {message}")
    if isinstance(exc, BotoConnectionError | HTTPClientError | IncompleteReadError):
        return TransientStorageError(f"cannot reach S3 while {action} {uri}: {exc}")
    if isinstance(exc, FlexibleChecksumError):
        # A download whose checksum does not match was corrupted on the way; a fresh read may not be.
        return TransientStorageError(f"checksum mismatch while {action} {uri}: {exc}")
    # Missing credentials, bad parameters: retrying will not help.
    return StorageError(f"S3 failed while {action} {uri}: {exc}")


@contextmanager
def _s3_errors(uri: str, action: str) -> Iterator[None]:
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise _storage_error(exc, uri, action) from exc


class _BodyReader(io.RawIOBase):
    """botocore's StreamingBody as a raw stream, so io.BufferedReader adds lines and buffering."""

    def __init__(self, body: Any, uri: str) -> None:
        self._body = body
        self._uri = uri

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        with memoryview(buffer) as view, view.cast("B") as target:
            with _s3_errors(self._uri, "reading"):
                chunk = self._body.read(len(target))
            target[: len(chunk)] = chunk
            return len(chunk)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


class _Upload(io.RawIOBase):
    """Gathers written bytes into parts; the first full part turns the PUT into a multipart upload."""

    def __init__(self, client: Any, bucket: str, key: str, uri: str, part_bytes: int) -> None:
        self._client = client
        self._bucket = bucket
        self._key = key
        self._uri = uri
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._abandoned = False
        # As boto3's own transfer manager does: botocore puts a CRC32 on every part by default, and
        # S3 then wants the upload declared as CRC32 and each part's checksum repeated on completion.
        # AWS_REQUEST_CHECKSUM_CALCULATION=when_required turns both off (for stores without checksums).
        checksums = client.meta.config.request_checksum_calculation == "when_supported"
        self._checksum_args = {"ChecksumAlgorithm": "CRC32"} if checksums else {}

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        with memoryview(data) as view, view.cast("B") as source:
            if self._abandoned:
                # The BufferedWriter's last flush after an abort: the object is gone, drop the tail.
                return len(source)
            offset = 0
            while offset < len(source):
                room = self._part_bytes - len(self._buffer)
                self._buffer += source[offset : offset + room]
                offset += room
                if len(self._buffer) == self._part_bytes:
                    self._upload_part()
            return len(source)

    def _upload_part(self) -> None:
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise StorageError(f"{self._uri} needs more than {MAX_PARTS} parts; raise BATCHERY_S3_PART_BYTES")
        with _s3_errors(self._uri, "writing"):
            if self._upload_id is None:
                created = self._client.create_multipart_upload(
                    Bucket=self._bucket, Key=self._key, **self._checksum_args
                )
                self._upload_id = created["UploadId"]
            response = self._client.upload_part(
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=self._buffer,
                **self._checksum_args,
            )
        part = {"PartNumber": number, "ETag": response["ETag"]}
        if "ChecksumCRC32" in response:
            part["ChecksumCRC32"] = response["ChecksumCRC32"]
        self._parts.append(part)
        # A fresh buffer rather than clearing: botocore may still hold the old one, and memory stays at one part.
        self._buffer = bytearray()

    def finish(self) -> None:
        with _s3_errors(self._uri, "writing"):
            if self._upload_id is None:
                self._client.put_object(Bucket=self._bucket, Key=self._key, Body=self._buffer)
                return
            if self._buffer:
                self._upload_part()
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}
            )

    def abandon(self) -> None:
        self._abandoned = True
        self._buffer = bytearray()
        if self._upload_id is None:
            return
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
        except (ClientError, BotoCoreError):
            # Never hide the writer's own error; the upload stays invisible until a lifecycle rule ends it.
            logger.warning("could not abort the multipart upload %s of %s", self._upload_id, self._uri, exc_info=True)


class S3Store:
    """The `s3://` backend; one instance serves every bucket the process's credentials reach."""

    def __init__(self) -> None:
        self._clients = S3Clients()

    def _client(self) -> Any:
        return self._clients.get()

    def open_read(self, uri: str) -> BinaryIO:
        bucket, key = _object_of(uri)
        with _s3_errors(uri, "reading"):
            response = self._client().get_object(Bucket=bucket, Key=key)
        return io.BufferedReader(_BodyReader(response["Body"], uri), buffer_size=_READ_BUFFER_BYTES)

    @contextmanager
    def open_write(self, uri: str) -> Iterator[BinaryIO]:
        bucket, key = _object_of(uri)
        part_bytes = S3_PART_BYTES.read()
        upload = _Upload(self._client(), bucket, key, uri, part_bytes)
        writer = io.BufferedWriter(upload, buffer_size=_WRITE_BUFFER_BYTES)
        try:
            yield writer
            writer.flush()
            upload.finish()
        except BaseException:
            upload.abandon()
            raise
        finally:
            writer.close()

    def put_if_absent(self, uri: str, data: bytes) -> bool:
        bucket, key = _object_of(uri)
        for attempt in range(_CONFLICT_ATTEMPTS):
            if attempt:
                # S3 answers 409 while a concurrent write to the key is in flight and asks for a retry.
                time.sleep(0.05 * 2**attempt)
            try:
                self._client().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as exc:
                code, status = _error_code(exc)
                if code == "PreconditionFailed" or status == 412:
                    return self._created_by_lost_reply(exc, uri, data)
                if code != "ConditionalRequestConflict" and status != 409:
                    raise _storage_error(exc, uri, "creating") from exc
            except BotoCoreError as exc:
                raise _storage_error(exc, uri, "creating") from exc
        raise TransientStorageError(f"S3 kept reporting conflicting writes while creating {uri}")

    def _created_by_lost_reply(self, exc: ClientError, uri: str, data: bytes) -> bool:
        # When botocore retried, an earlier attempt of ours may have created the object and lost
        # only its reply; the 412 then answers our own write. Reporting False would make the
        # caller discard its work as a loser's, so the object's content decides.
        if not exc.response.get("ResponseMetadata", {}).get("RetryAttempts"):
            return False
        return self.read_bytes(uri) == data

    def read_bytes(self, uri: str) -> bytes:
        bucket, key = _object_of(uri)
        with _s3_errors(uri, "reading"):
            body = self._client().get_object(Bucket=bucket, Key=key)["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
        return data

    def exists(self, uri: str) -> bool:
        bucket, key = _object_of(uri)
        try:
            self._client().head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if _error_code(exc)[1] == 404:
                return False
            raise _storage_error(exc, uri, "inspecting") from exc
        except BotoCoreError as exc:
            raise _storage_error(exc, uri, "inspecting") from exc
        return True

    def size(self, uri: str) -> int:
        bucket, key = _object_of(uri)
        with _s3_errors(uri, "inspecting"):
            return int(self._client().head_object(Bucket=bucket, Key=key)["ContentLength"])

    def _listed_under(self, uri: str, action: str) -> Iterator[tuple[str, dict[str, Any]]]:
        bucket, key = parse_s3_uri(uri)
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=_folder(key))
        with _s3_errors(uri, action):
            for page in pages:
                for item in page.get("Contents", []):
                    yield bucket, item

    def _keys_under(self, uri: str, action: str) -> Iterator[tuple[str, str]]:
        for bucket, item in self._listed_under(uri, action):
            yield bucket, item["Key"]

    def prefix_bytes(self, uri: str) -> int:
        return sum(int(item["Size"]) for _, item in self._listed_under(uri, "measuring"))

    def list_prefix(self, uri: str) -> Iterator[str]:
        for bucket, key in self._keys_under(uri, "listing"):
            # Zero-byte "folder" markers made by consoles and tools are not objects a caller wants.
            if not key.endswith("/"):
                yield f"s3://{bucket}/{key}"

    def delete_prefix(self, uri: str) -> None:
        bucket, key = parse_s3_uri(uri)
        # As with file://, the prefix may itself name an object; deleting a missing key is no error.
        batch = [key] if key.strip("/") else []
        for _, listed in self._keys_under(uri, "deleting"):
            batch.append(listed)
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(uri, bucket, batch)
                batch = []
        if batch:
            self._delete_batch(uri, bucket, batch)

    def _delete_batch(self, uri: str, bucket: str, keys: list[str]) -> None:
        with _s3_errors(uri, "deleting"):
            response = self._client().delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True}
            )
        errors = response.get("Errors", [])
        if errors:
            first = errors[0]
            raise StorageError(
                f"could not delete {len(errors)} objects under {uri}, e.g. {first.get('Key')} (S3 {first.get('Code')})"
            )

    def presigned_get(self, uri: str, expires_s: int = 3600) -> str:
        """A URL that downloads the object without credentials until it expires (at most 7 days)."""
        return self._presign("get_object", uri, expires_s)

    def presigned_put(self, uri: str, expires_s: int = 3600) -> str:
        """A URL that uploads the object with a plain HTTP PUT until it expires (at most 7 days)."""
        return self._presign("put_object", uri, expires_s)

    def _presign(self, operation: str, uri: str, expires_s: int) -> str:
        bucket, key = _object_of(uri)
        with _s3_errors(uri, "signing"):
            url: str = self._client().generate_presigned_url(
                operation, Params={"Bucket": bucket, "Key": key}, ExpiresIn=expires_s
            )
        return url
