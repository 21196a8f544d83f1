"""/v1/files and /v1/batches refuse bad input clearly: line-numbered errors, 413, unknown endpoints and models,
and 429 once batches still validating fill the tenant's concurrent jobs."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from celery.signals import before_task_publish

from portal.jobs.models import Job
from portal.openai_api.models import Batch, File
from portal.tenancy.models import Membership, Quota
from tasks.shared.config import VALIDATE_BATCH_TASK
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db


def _upload(caller: Caller, lines: list[Any], purpose: str = "batch") -> Any:
    content = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    handle = io.BytesIO(content)
    handle.name = "requests.jsonl"
    return caller.client.post("/v1/files", {"file": handle, "purpose": purpose}, format="multipart")


def _request(n: int, model: str = "all-MiniLM-L6-v2", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"r{n}",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, "input": f"t{n}", **body},
    }


def _create(caller: Caller, file_id: str, endpoint: str = "/v1/embeddings", **extra: Any) -> Any:
    return caller.client.post(
        "/v1/batches",
        {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra},
        format="json",
    )


def test_a_batch_with_bad_lines_is_failed_with_errors_naming_the_lines(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    file_id = _upload(alice, [_request(0), "{broken", {**_request(2), "url": "/v1/completions"}, _request(0)]).json()[
        "id"
    ]
    response = _create(alice, file_id)
    assert response.status_code == 200
    batch = response.json()
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    errors = batch["errors"]["data"]
    assert [(error["line"], error["code"]) for error in errors] == [
        (2, "invalid_json"),
        (3, "invalid_url"),
        (4, "duplicate_custom_id"),
    ]
    assert not Job.objects.exists()
    assert alice.client.get(f"/v1/batches/{batch['id']}").json()["status"] == "failed"


def test_a_batch_whose_lines_name_several_models_is_refused_naming_them(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    file_id = _upload(alice, [_request(0), _request(1, model="other-model")]).json()["id"]
    errors = _create(alice, file_id).json()["errors"]["data"]
    assert errors[0]["code"] == "mixed_models" and errors[0]["line"] == 2
    assert "all-MiniLM-L6-v2" in errors[0]["message"] and "other-model" in errors[0]["message"]


def test_an_unknown_model_or_endpoint_or_window_is_a_400_naming_the_field(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    unknown = _upload(alice, [_request(0, model="gpt-17")]).json()["id"]
    response = _create(alice, unknown)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body.model" and "gpt-17" in response.json()["error"]["message"]
    good = _upload(alice, [_request(0)]).json()["id"]
    assert _create(alice, good, endpoint="/v1/images/generations").json()["error"]["param"] == "endpoint"
    wrong_task = _create(alice, good, endpoint="/v1/chat/completions")
    assert wrong_task.status_code == 200 and wrong_task.json()["errors"]["data"][0]["code"] == "invalid_url"
    window = alice.client.post(
        "/v1/batches", {"input_file_id": good, "endpoint": "/v1/embeddings", "completion_window": "1w"}, format="json"
    )
    assert window.json()["error"]["param"] == "completion_window"
    assert not Job.objects.exists()
    assert not Batch.objects.exclude(validation_errors=None).filter(job__isnull=False).exists()


def test_a_model_of_the_wrong_task_for_the_endpoint_is_refused_and_no_job_is_left(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    chat_line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": minilm.name, "messages": [{"role": "user", "content": "hi"}]},
    }
    response = _create(alice, _upload(alice, [chat_line]).json()["id"], endpoint="/v1/chat/completions")
    assert response.status_code == 400
    assert "serves task 'embed'" in response.json()["error"]["message"]
    assert not Job.objects.exists() and not Batch.objects.exists()


def test_files_refuse_a_wrong_purpose_an_oversized_upload_and_viewers(
    caller: Callable[..., Caller], settings: Any
) -> None:
    alice = caller("acme")
    assert _upload(alice, [_request(0)], purpose="fine-tune").json()["error"]["param"] == "purpose"
    settings.BATCHERY_MAX_UPLOAD_BYTES = 100
    too_big = _upload(alice, [_request(n) for n in range(10)])
    assert too_big.status_code == 413
    viewer = caller(alice.tenant, Membership.Role.VIEWER)
    settings.BATCHERY_MAX_UPLOAD_BYTES = 10_000
    assert _upload(viewer, [_request(0)]).status_code == 403
    assert not File.objects.exists()


def test_files_list_pages_with_after_and_limit_and_delete(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    ids = [_upload(alice, [_request(n)]).json()["id"] for n in range(5)]
    first = alice.client.get("/v1/files", {"limit": 2}).json()
    assert [row["id"] for row in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = alice.client.get("/v1/files", {"limit": 10, "after": first["last_id"]}).json()
    assert [row["id"] for row in rest["data"]] == ids[::-1][2:] and not rest["has_more"]
    deleted = alice.client.delete(f"/v1/files/{ids[0]}").json()
    assert deleted == {"id": ids[0], "object": "file", "deleted": True}
    assert alice.client.get(f"/v1/files/{ids[0]}").status_code == 404


def test_batches_still_validating_count_against_max_concurrent_jobs_and_validate_on_their_own_queue(
    caller: Callable[..., Caller], minilm: Any, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    """One large file posted again and again queues no more validations than the tenant may run jobs."""
    settings.BATCHERY_BATCH_SYNC_VALIDATION_BYTES = 1  # every file is validated off the request
    alice = caller("acme")
    Quota.objects.filter(tenant=alice.tenant).update(max_concurrent_jobs=2)
    file_id = _upload(alice, [_request(0), _request(1)]).json()["id"]
    published: list[tuple[str, str]] = []

    def seen(sender: str, routing_key: str, **_: object) -> None:
        published.append((sender, routing_key))

    before_task_publish.connect(seen)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            answers = [_create(alice, file_id) for _ in range(3)]
    finally:
        before_task_publish.disconnect(seen)

    assert [answer.status_code for answer in answers] == [200, 200, 429]
    assert [answer.json()["status"] for answer in answers[:2]] == ["validating", "validating"]
    error = answers[2].json()["error"]
    assert error["code"] == "quota_exceeded" and error["param"] == "max_concurrent_jobs", error
    assert "limit 2" in error["message"] and "2 batches validating" in error["message"], error
    assert Batch.objects.count() == 2
    assert published == [(VALIDATE_BATCH_TASK, "validation")] * 2
