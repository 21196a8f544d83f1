"""Bounds on what one tenant may ask of the shared GPUs and storage: `n`, `max_tokens`, shards per
job, stored uploads, and the default on queued records."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.engines.sampling import ParamError, sampling_kwargs
from gpuworkers.engines.transformers import GenerationParams
from portal.catalog.models import Model
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.openai_api.models import File
from portal.tenancy.models import DEFAULT_MAX_QUEUED_RECORDS, Quota, Tenant
from tests.api.conftest import Caller
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("params", "field", "setting"),
    [
        ({"n": 17}, "n", "BATCHERY_MAX_N"),
        ({"max_tokens": 32769}, "max_tokens", "BATCHERY_MAX_OUTPUT_TOKENS"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens", "BATCHERY_MAX_OUTPUT_TOKENS"),
    ],
)
def test_the_vllm_engine_refuses_a_record_asking_past_the_platform_limits(
    params: dict[str, int], field: str, setting: str
) -> None:
    with pytest.raises(ParamError) as refused:
        sampling_kwargs(params)
    assert refused.value.field == field and setting in str(refused.value)
    assert sampling_kwargs({"n": 16, "max_tokens": 32768}) == {"n": 16, "max_tokens": 32768}


def test_the_transformers_engine_refuses_max_tokens_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_OUTPUT_TOKENS", "64")
    with pytest.raises(ParamError, match="over this platform's limit of 64"):
        GenerationParams.from_mapping({"max_tokens": 65})
    assert GenerationParams.from_mapping({"max_tokens": 64}).max_tokens == 64


def test_a_job_asking_for_too_many_tokens_is_refused_at_submission_naming_the_limit(
    caller: Callable[..., Caller], tmp_path: Path, write_jsonl: Callable[..., Path]
) -> None:
    ModelFactory(name="tiny-gen", engine=Model.Engine.TRANSFORMERS, task=Model.Task.GENERATE, source=str(tmp_path))
    alice = caller("acme")
    with write_jsonl([{"custom_id": "a", "prompt": "hi"}]).open("rb") as handle:
        response = alice.client.post(
            "/api/v1/jobs/",
            {"file": handle, "model": "tiny-gen", "params": json.dumps({"max_tokens": 1_000_000})},
            format="multipart",
        )
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["param"] == "params" and "BATCHERY_MAX_OUTPUT_TOKENS" in error["message"]
    assert not Job.objects.exists()


def test_an_openai_batch_line_asking_for_too_many_completions_is_refused_naming_the_line(
    caller: Callable[..., Caller], tmp_path: Path
) -> None:
    ModelFactory(name="tiny-chat", engine=Model.Engine.VLLM, task=Model.Task.CHAT, source=str(tmp_path))
    alice = caller("acme")
    lines = [
        {"custom_id": f"c{n}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "n": 1 if n else 64}}
        for n in range(3)
    ]  # fmt: skip
    upload = io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    upload.name = "batch.jsonl"
    file_id = alice.client.post("/v1/files", {"file": upload, "purpose": "batch"}, format="multipart").json()["id"]
    response = alice.client.post(
        "/v1/batches",
        {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        format="json",
    )
    body = response.json()
    assert body["status"] == "failed", body
    assert body["errors"]["data"] == [
        {"code": "invalid_param", "param": "body.n", "line": 1,
         "message": "body.n is 64, over this platform's limit of 16 (BATCHERY_MAX_N)"}
    ]  # fmt: skip


def test_planning_fails_a_job_cut_into_more_shards_than_one_job_may_have(
    acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path], settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0  # the planner reads the input, as for a large one
    settings.BATCHERY_MAX_SHARDS_PER_JOB = 3
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(10)])
    job = job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=1))
    with django_capture_on_commit_callbacks(execute=False):
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "more than 3 shards" in job.error and "BATCHERY_MAX_SHARDS_PER_JOB" in job.error
    assert job.shards.count() <= 3


def test_uploads_past_the_tenants_stored_bytes_are_refused_429_and_deleting_frees_room(
    caller: Callable[..., Caller], django_capture_on_commit_callbacks: Any
) -> None:
    alice = caller("acme")
    Quota.objects.filter(tenant=alice.tenant).update(max_stored_bytes=1500)
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "m", "input": "y" * 800}}).encode() + b"\n"  # fmt: skip

    def upload() -> Any:
        handle = io.BytesIO(line)
        handle.name = "b.jsonl"
        return alice.client.post("/v1/files", {"file": handle, "purpose": "batch"}, format="multipart")

    first = upload()
    assert first.status_code == 200, first.json()
    refused = upload()
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "quota_exceeded" and error["param"] == "max_stored_bytes"
    assert error["quota"]["limit"] == 1500 and error["quota"]["current"] == len(line)
    assert File.objects.count() == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert alice.client.delete(f"/v1/files/{first.json()['id']}").status_code == 200
    assert upload().status_code == 200


def test_a_new_tenant_has_bounded_queued_records_and_stored_bytes() -> None:
    quota = Quota.objects.get(tenant=TenantFactory(name="fresh"))
    assert quota.max_queued_records == DEFAULT_MAX_QUEUED_RECORDS
    assert quota.max_stored_bytes == 50 * 1024**3
