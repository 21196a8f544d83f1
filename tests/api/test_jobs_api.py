"""/api/v1/jobs/: submit from an upload or a URI, errors that name the problem, filters, actions."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from portal.jobs.models import Job, JobStatus
from portal.jobs.services.uploads import uploads_root
from portal.tenancy.models import Membership, Quota
from tests.api.conftest import Caller
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db

RECORDS = [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(5)]


def _upload(client: Any, path: Path, **fields: Any) -> Any:
    with path.open("rb") as handle:
        return client.post("/api/v1/jobs/", {"file": handle, **fields}, format="multipart")


def test_an_uploaded_file_becomes_a_queued_job_with_its_progress(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(
        alice.client, write_jsonl(RECORDS), model=minilm.name, params=json.dumps({"normalize": True}), shard_size=2
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued"
    assert body["model"] == minilm.name
    assert body["params"] == {"normalize": True}
    assert body["total_records"] == 5
    assert body["progress"] == {"total": 5, "done": 0, "failed": 0, "fraction": 0.0}
    job = Job.objects.get(pk=body["id"])
    assert job.tenant == alice.tenant and job.created_by == alice.user
    assert f"/uploads/{alice.tenant.pk}/" in job.input_uri
    assert alice.client.get(f"/api/v1/jobs/{job.pk}/").json()["id"] == str(job.pk)


def test_a_uri_input_must_lie_under_an_allowed_root(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    path = write_jsonl(RECORDS)
    outside = alice.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": path.as_uri()}, format="json")
    assert outside.status_code == 400
    assert outside.json()["error"]["param"] == "input_uri"
    assert "outside" in outside.json()["error"]["message"]
    climbing = (tmp_path / "data" / ".." / path.name).as_uri()
    with override_settings(BATCHERY_INPUT_ROOTS=[(tmp_path / "data").as_uri()]):
        assert (
            alice.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": climbing}, format="json").status_code
            == 400
        )
    with override_settings(BATCHERY_INPUT_ROOTS=[tmp_path.as_uri()]):
        inside = alice.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": path.as_uri()}, format="json")
    assert inside.status_code == 201, inside.json()


def test_malformed_json_gets_400_naming_the_problem(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    response = alice.client.post("/api/v1/jobs/", data="{not json", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "JSON parse error" in response.json()["error"]["message"]


def test_missing_and_wrong_fields_get_400_with_field_errors(caller: Callable[..., Caller], minilm: Any) -> None:
    alice = caller("acme")
    response = alice.client.post("/api/v1/jobs/", {"shard_size": 0, "params": [1]}, format="json")
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert set(fields) >= {"model", "shard_size", "params"}
    assert fields["params"] == ["must be a JSON object"]
    both = alice.client.post("/api/v1/jobs/", {"model": minilm.name}, format="json")
    assert both.json()["error"]["param"] == "input_uri"


def test_an_unknown_model_gets_400_listing_the_models_available(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(alice.client, write_jsonl(RECORDS), model="gpt-17")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model"
    assert "'gpt-17'" in error["message"] and minilm.name in error["message"]


def test_bad_lines_get_400_naming_each_line_and_the_upload_is_not_kept(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(alice.client, write_jsonl([RECORDS[0], "not json", {"custom_id": "x"}]), model=minilm.name)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "file"
    assert [line["line"] for line in error["lines"]] == [2, 3]
    assert "missing field 'input'" in error["lines"][1]["message"]
    uploads = Path(uploads_root(alice.tenant.pk).removeprefix("file://"))
    assert not any(path.is_file() for path in uploads.rglob("*"))


def test_an_upload_over_the_limit_gets_413_and_nothing_is_kept(
    caller: Callable[..., Caller], minilm: Any, settings: Any
) -> None:
    settings.BATCHERY_MAX_UPLOAD_BYTES = 1000
    alice = caller("acme")
    big = io.BytesIO(b"".join(json.dumps({"custom_id": str(n), "input": "x" * 50}).encode() + b"\n" for n in range(50)))
    big.name = "big.jsonl"
    response = alice.client.post("/api/v1/jobs/", {"file": big, "model": minilm.name}, format="multipart")
    assert response.status_code == 413
    assert "1000 bytes" in response.json()["error"]["message"]
    assert not Job.objects.exists()


def test_a_model_outside_the_quota_is_refused_as_one_that_does_not_exist(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    other = ModelFactory(name="other-embedder", is_default=False)
    Quota.objects.get(tenant=alice.tenant).allowed_models.set([other])
    assert [row["name"] for row in alice.client.get("/api/v1/models/").json()] == ["other-embedder"]
    outside = _upload(alice.client, write_jsonl(RECORDS), model=minilm.name)
    missing = _upload(alice.client, write_jsonl(RECORDS), model="no-such-model")
    assert outside.status_code == missing.status_code == 400
    assert outside.json() == json.loads(json.dumps(missing.json()).replace("no-such-model", minilm.name))
    assert "models available: other-embedder" in outside.json()["error"]["message"]


def test_lists_filter_by_status_model_and_date_and_page_by_cursor(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    Quota.objects.filter(tenant=alice.tenant).update(max_concurrent_jobs=None)
    path = write_jsonl(RECORDS)
    ids = [_upload(alice.client, path, model=minilm.name).json()["id"] for _ in range(5)]
    Job.objects.filter(pk=ids[0]).update(status=JobStatus.FAILED)
    failed = alice.client.get("/api/v1/jobs/", {"status": "failed"}).json()["results"]
    assert [row["id"] for row in failed] == [ids[0]]
    assert len(alice.client.get("/api/v1/jobs/", {"model": minilm.name}).json()["results"]) == 5
    assert alice.client.get("/api/v1/jobs/", {"model": "nope"}).json()["results"] == []
    created = Job.objects.get(pk=ids[2]).created_at.isoformat()
    assert len(alice.client.get("/api/v1/jobs/", {"created_after": created}).json()["results"]) == 3
    bad_status = alice.client.get("/api/v1/jobs/", {"status": "sleeping"})
    assert bad_status.status_code == 400 and bad_status.json()["error"]["param"] == "status"

    seen, page = [], alice.client.get("/api/v1/jobs/", {"limit": 2}).json()
    while True:
        seen += [row["id"] for row in page["results"]]
        if not page["next"]:
            break
        page = alice.client.get(page["next"]).json()
    assert seen == list(reversed(ids))


def test_cancel_retry_and_downloads_answer_409_when_the_job_is_not_in_a_state_for_them(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    viewer = caller(alice.tenant, Membership.Role.VIEWER)
    job_id = _upload(alice.client, write_jsonl(RECORDS), model=minilm.name).json()["id"]
    assert alice.client.get(f"/api/v1/jobs/{job_id}/output/").status_code == 409
    assert alice.client.post(f"/api/v1/jobs/{job_id}/retry/").status_code == 409
    assert viewer.client.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 403
    cancelled = alice.client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    again = alice.client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert again.status_code == 409
    assert again.json()["error"]["type"] == "conflict_error"
