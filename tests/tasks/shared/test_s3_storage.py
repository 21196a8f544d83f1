"""The s3:// backend against a real moto_server process on 127.0.0.1."""

from __future__ import annotations

import hashlib
import io
import shutil
import threading
import time
import urllib.request
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from portal.devstack.embedded import free_port
from tasks.shared.storage import S3Store, StorageError, TransientStorageError, s3, store_for
from tasks.shared.storage.s3 import MIN_PART_BYTES, _storage_error, parse_s3_uri

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024


@pytest.fixture
def store(s3_env: str) -> S3Store:
    """A fresh store, so its client is built from this test's environment."""
    return S3Store()


@pytest.fixture
def admin(s3_env: str) -> Any:
    """A plain boto3 client to set up buckets and look behind the store's back."""
    return boto3.client("s3", endpoint_url=s3_env)


def _etag(admin: Any, bucket: str, key: str) -> str:
    return str(admin.head_object(Bucket=bucket, Key=key)["ETag"]).strip('"')


def test_a_small_object_round_trips_with_a_single_put(store: S3Store, admin: Any, bucket: str) -> None:
    uri = f"s3://{bucket}/jobs/1/output.jsonl"
    assert not store.exists(uri)
    with store.open_write(uri) as out:
        out.write(b'{"a": 1}\n')
        out.write(b'{"a": 2}\n')
    assert store.read_bytes(uri) == b'{"a": 1}\n{"a": 2}\n'
    assert store.exists(uri)
    assert store.size(uri) == 18
    assert "-" not in _etag(admin, bucket, "jobs/1/output.jsonl")


def test_an_empty_write_creates_an_empty_object(store: S3Store, bucket: str) -> None:
    uri = f"s3://{bucket}/empty"
    with store.open_write(uri):
        pass
    assert store.read_bytes(uri) == b""


def test_a_large_object_is_uploaded_in_parts_and_streams_back(store: S3Store, admin: Any, bucket: str) -> None:
    uri = f"s3://{bucket}/big.bin"
    data = hashlib.shake_256(b"batchery").digest(12 * MIB)
    with store.open_write(uri) as out:
        for offset in range(0, len(data), MIB):
            out.write(data[offset : offset + MIB])
    assert _etag(admin, bucket, "big.bin").endswith("-3")  # 5 + 5 + 2 MiB
    # The parts' CRC32s were declared and handed back on completion, as AWS requires.
    assert "ChecksumCRC32" in admin.head_object(Bucket=bucket, Key="big.bin", ChecksumMode="ENABLED")
    assert store.size(uri) == len(data)
    copy = io.BytesIO()
    with store.open_read(uri) as source:
        shutil.copyfileobj(source, copy, 256 * 1024)
    assert copy.getvalue() == data
    with store.open_read(uri) as source:
        assert source.read(10) == data[:10]
        assert source.read(MIB) == data[10 : 10 + MIB]


def test_a_large_object_reads_line_by_line(store: S3Store, bucket: str) -> None:
    uri = f"s3://{bucket}/lines.jsonl"
    lines = [b'{"custom_id": "r%d", "input": "%s"}\n' % (n, b"x" * (n % 97)) for n in range(150_000)]
    with store.open_write(uri) as out:
        for line in lines:
            out.write(line)
    assert store.size(uri) > 2 * MIN_PART_BYTES
    with store.open_read(uri) as reader:
        assert reader.readline() == lines[0]
        assert list(reader) == lines[1:]
        assert reader.read(1) == b""
    assert reader.closed


def test_a_write_that_fails_leaves_no_object_and_no_pending_upload(store: S3Store, admin: Any, bucket: str) -> None:
    for size, key in ((100, "small"), (MIN_PART_BYTES + MIB, "large")):
        uri = f"s3://{bucket}/{key}"
        with pytest.raises(RuntimeError, match="writer died"), store.open_write(uri) as out:
            out.write(b"x" * size)
            raise RuntimeError("writer died")
        assert not store.exists(uri)
    assert "Uploads" not in admin.list_multipart_uploads(Bucket=bucket)
    assert "Contents" not in admin.list_objects_v2(Bucket=bucket)


def test_put_if_absent_lets_the_first_writer_win(store: S3Store, bucket: str) -> None:
    uri = f"s3://{bucket}/shards/0/commit.json"
    assert store.put_if_absent(uri, b"first") is True
    assert store.put_if_absent(uri, b"second") is False
    assert store.read_bytes(uri) == b"first"


def test_put_if_absent_lets_exactly_one_of_many_concurrent_writers_win(store: S3Store, bucket: str) -> None:
    uri = f"s3://{bucket}/shards/1/commit.json"
    results: dict[int, bool] = {}
    start = threading.Barrier(16)

    def attempt(n: int) -> None:
        start.wait(timeout=10)
        results[n] = store.put_if_absent(uri, f"attempt-{n}".encode())

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [n for n, won in results.items() if won]
    assert len(results) == 16
    assert len(winners) == 1
    assert store.read_bytes(uri) == f"attempt-{winners[0]}".encode()


class _LostReplyClient:
    """A client whose put answers 412 after a retry, as when the first attempt's reply was lost."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def put_object(self, **_: Any) -> None:
        response: Any = {
            "Error": {"Code": "PreconditionFailed", "Message": "At least one of the pre-conditions failed"},
            "ResponseMetadata": {"HTTPStatusCode": 412, "RetryAttempts": 1},
        }
        raise ClientError(response, "PutObject")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_put_if_absent_claims_an_object_its_own_lost_reply_created(
    store: S3Store, admin: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"s3://{bucket}/shards/2/commit.json"
    admin.put_object(Bucket=bucket, Key="shards/2/commit.json", Body=b"ours")
    monkeypatch.setattr(store, "_client", lambda: _LostReplyClient(admin))
    assert store.put_if_absent(uri, b"ours") is True
    assert store.put_if_absent(uri, b"theirs") is False


def test_list_prefix_yields_the_objects_under_a_folder_in_key_order(store: S3Store, admin: Any, bucket: str) -> None:
    for key in ("p/b", "p/a", "p/c/d", "p/", "p10/x", "q"):
        admin.put_object(Bucket=bucket, Key=key, Body=b"1")
    assert list(store.list_prefix(f"s3://{bucket}/p")) == [
        f"s3://{bucket}/p/a",
        f"s3://{bucket}/p/b",
        f"s3://{bucket}/p/c/d",
    ]
    assert list(store.list_prefix(f"s3://{bucket}/p/")) == list(store.list_prefix(f"s3://{bucket}/p"))
    assert list(store.list_prefix(f"s3://{bucket}/missing")) == []
    store.delete_prefix(f"s3://{bucket}/p")
    store.delete_prefix(f"s3://{bucket}/q")
    store.delete_prefix(f"s3://{bucket}/never-there")
    remaining = [item["Key"] for item in admin.list_objects_v2(Bucket=bucket)["Contents"]]
    assert remaining == ["p10/x"]


def test_delete_prefix_deletes_in_batches(
    store: S3Store, admin: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # S3 takes 1000 keys per DeleteObjects; a small batch tests the batching without 1000s of slow PUTs.
    monkeypatch.setattr(s3, "_DELETE_BATCH", 10)
    keys = [f"many/{n:03d}" for n in range(25)]
    for key in keys:
        admin.put_object(Bucket=bucket, Key=key, Body=b"")
    listed = list(store.list_prefix(f"s3://{bucket}/many"))
    assert listed == [f"s3://{bucket}/{key}" for key in keys]
    store.delete_prefix(f"s3://{bucket}/many")
    assert list(store.list_prefix(f"s3://{bucket}/many")) == []


def test_a_missing_object_or_bucket_is_a_storage_error_naming_it(store: S3Store, bucket: str) -> None:
    uri = f"s3://{bucket}/missing.jsonl"
    for operation in (store.open_read, store.read_bytes, store.size):
        with pytest.raises(StorageError, match=rf"no such object: s3://{bucket}/missing\.jsonl") as caught:
            operation(uri)
        assert not isinstance(caught.value, TransientStorageError)
    with pytest.raises(StorageError, match=r"no such bucket .*s3://no-such-bucket-here/x \(S3 NoSuchBucket\)"):
        store.open_read("s3://no-such-bucket-here/x")
    with pytest.raises(StorageError, match="NoSuchBucket"):
        list(store.list_prefix("s3://no-such-bucket-here/x"))


def test_presigned_urls_download_and_upload_without_credentials(store: S3Store, bucket: str) -> None:
    uri = f"s3://{bucket}/results/output.jsonl"
    with store.open_write(uri) as out:
        out.write(b"line\n")
    with urllib.request.urlopen(store.presigned_get(uri, expires_s=60), timeout=10) as response:
        assert response.read() == b"line\n"
    upload_uri = f"s3://{bucket}/uploads/input.jsonl"
    request = urllib.request.Request(
        store.presigned_put(upload_uri, expires_s=60),
        data=b"in\n",
        method="PUT",
        # urllib's default form content type would make the server parse the body as a form.
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    assert store.read_bytes(upload_uri) == b"in\n"


def test_a_server_that_is_down_is_a_transient_error(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("BATCHERY_S3_MAX_ATTEMPTS", "2")
    store = S3Store()
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match=r"cannot reach S3 while reading s3://some-bucket/x"):
        store.open_read("s3://some-bucket/x")
    with pytest.raises(TransientStorageError), store.open_write("s3://some-bucket/y") as out:
        out.write(b"data")
    with pytest.raises(TransientStorageError):
        store.put_if_absent("s3://some-bucket/z", b"data")
    assert time.monotonic() - started < 20


def test_the_s3_specific_endpoint_wins_over_the_general_one(
    s3_env: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env)
    store = S3Store()
    assert store.put_if_absent(f"s3://{bucket}/k", b"v")
    assert store.read_bytes(f"s3://{bucket}/k") == b"v"


def test_throttling_is_transient_and_denial_is_not() -> None:
    def client_error(code: str, status: int) -> ClientError:
        response: Any = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return ClientError(response, "GetObject")

    for code, status in (("SlowDown", 503), ("RequestTimeout", 400), ("InternalError", 500)):
        assert isinstance(_storage_error(client_error(code, status), "s3://b-1/k", "reading"), TransientStorageError)
    denied = _storage_error(client_error("AccessDenied", 403), "s3://b-1/k", "reading")
    assert not isinstance(denied, TransientStorageError)
    assert "s3://b-1/k" in str(denied)
    assert "AccessDenied" in str(denied)


@pytest.mark.parametrize("uri", ["s3://", "s3:///key", "s3://Upper-Case/key", "s3://a/key", "gs://bucket/key"])
def test_malformed_s3_uris_are_refused(uri: str) -> None:
    with pytest.raises(StorageError):
        parse_s3_uri(uri)


def test_object_operations_need_a_key() -> None:
    with pytest.raises(StorageError, match="names no object"):
        S3Store().open_read("s3://bucket/folder/")


def test_the_registry_hands_out_one_s3_store_and_still_refuses_http() -> None:
    assert isinstance(store_for("s3://bucket-a/x"), S3Store)
    assert store_for("s3://bucket-a/x") is store_for("s3://bucket-b/y")
    for uri in ("http://example.com/x", "https://example.com/x"):
        with pytest.raises(StorageError, match=r"unsupported storage URI scheme .*supported: file://, s3://"):
            store_for(uri)
