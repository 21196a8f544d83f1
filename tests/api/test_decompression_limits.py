"""/api/v1/jobs/ and the quota: a compressed input is judged by what it decompresses to. A bomb of a few
hundred KB is refused with 400 `input_too_large` naming the limit and its setting, its upload not
kept; the tenant's `max_input_bytes` counts decompressed bytes (429)."""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from portal.jobs.models import Job
from portal.jobs.services.uploads import uploads_root
from portal.tenancy.models import Quota
from tests.api.conftest import Caller
from tests.support.bombs import LINE, MiB, gzip_bomb, written_bytes, zstd_bomb

pytestmark = pytest.mark.django_db


def _post(client: Any, name: str, data: bytes, **fields: Any) -> Any:
    upload = io.BytesIO(data)
    upload.name = name
    return client.post("/api/v1/jobs/", {"file": upload, **fields}, format="multipart")


def _nothing_kept(caller: Caller) -> bool:
    uploads = Path(uploads_root(caller.tenant.pk).removeprefix("file://"))
    return not Job.objects.exists() and not any(path.is_file() for path in uploads.rglob("*"))


def test_a_zstd_bomb_upload_gets_400_naming_the_decompressed_size_limit(
    caller: Callable[..., Caller], minilm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_DECOMPRESSED_BYTES", str(8 * MiB))
    alice = caller("acme")
    response = _post(alice.client, "bomb.jsonl.zst", zstd_bomb(), model=minilm.name)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "input_too_large"
    assert error["limit"] == {"name": "BATCHERY_MAX_DECOMPRESSED_BYTES", "value": 8 * MiB}
    assert f"more than {8 * MiB} bytes" in error["message"] and "BATCHERY_MAX_DECOMPRESSED_BYTES" in error["message"]
    assert _nothing_kept(alice)


def test_a_parquet_bomb_in_gzip_gets_400_naming_the_ratio_at_the_default_limits(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    bomb = gzip_bomb(first=b"PAR1", filler=b"\0")
    assert len(bomb) < 400 * 1024
    response = _post(alice.client, "bomb.parquet.gz", bomb, model=minilm.name)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "input_too_large"
    assert error["limit"] == {"name": "BATCHERY_MAX_COMPRESSION_RATIO", "value": 100.0}
    assert _nothing_kept(alice)


def test_the_input_bytes_quota_counts_decompressed_bytes(caller: Callable[..., Caller], minilm: Any) -> None:
    alice = caller("acme")
    Quota.objects.filter(tenant=alice.tenant).update(max_input_bytes=100_000)
    data = gzip.compress(LINE * 64)  # 256 KiB decompressed, a KB or so compressed
    assert len(data) < 100_000
    response = _post(alice.client, "input.jsonl.gz", data, model=minilm.name)
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["quota"]["name"] == "max_input_bytes" and error["quota"]["limit"] == 100_000
    assert "quota max_input_bytes" in error["message"]
    assert _nothing_kept(alice)


def test_a_compressed_input_within_the_limits_is_accepted(caller: Callable[..., Caller], minilm: Any) -> None:
    alice = caller("acme")
    Quota.objects.filter(tenant=alice.tenant).update(max_input_bytes=1_000_000)
    response = _post(alice.client, "input.jsonl.gz", gzip.compress(LINE * 64), model=minilm.name)
    assert response.status_code == 201, response.json()


def test_an_openai_batch_of_a_compressed_bomb_fails_on_its_first_line_and_nothing_is_expanded(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    # /v1/files holds JSONL as OpenAI's does: the batch validation reads the file's bytes as they are,
    # never decompressing them, so a bomb is a file of bad lines and costs no more than its own size.
    alice = caller("acme")
    upload = io.BytesIO(zstd_bomb())
    upload.name = "requests.jsonl.zst"
    file_id = alice.client.post("/v1/files", {"file": upload, "purpose": "batch"}, format="multipart").json()["id"]
    written = written_bytes()
    response = alice.client.post(
        "/v1/batches",
        {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        format="json",
    )
    assert written_bytes() - written < MiB
    assert response.status_code == 200
    batch = response.json()
    assert batch["status"] == "failed"
    assert (batch["errors"]["data"][0]["line"], batch["errors"]["data"][0]["code"]) == (1, "invalid_json")
    assert not Job.objects.exists()
