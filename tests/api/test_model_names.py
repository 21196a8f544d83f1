"""The model names a tenant's requests give: a model outside its quota answers as one that does not exist
(submit, re-run), and the distinct `model` names one job's records give are looked up without a query each
and bounded (BATCHERY_MAX_RECORD_MODEL_NAMES), the line past the bound named."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.catalog.models import Model
from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Quota
from tests.api.conftest import Caller
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db


def _same_but_the_name(answer: Any, other: Any, name: str, other_name: str) -> bool:
    return bool(answer.json() == json.loads(json.dumps(other.json()).replace(other_name, name)))


def test_a_rerun_naming_a_model_outside_the_quota_answers_as_a_model_that_does_not_exist(
    settings: Any, tmp_path: Path, minilm: Model, caller: Callable[..., Caller]
) -> None:
    settings.BATCHERY_INPUT_ROOTS = [tmp_path.as_uri()]
    member = caller("acme")
    Quota.objects.get(tenant=member.tenant).allowed_models.set([minilm])
    path = tmp_path / "input.jsonl"
    path.write_text('{"input": "a"}\n')
    job = job_submit(
        tenant=member.tenant, user=member.user, request=JobRequest(model_name=minilm.name, input_uri=str(path))
    )
    # Another tenant's chat model: of another task than the job's, which a re-run once told.
    ModelFactory(name="secret-chat", task=Model.Task.CHAT, engine=Model.Engine.TRANSFORMERS, is_default=False)
    outside = member.client.post(f"/api/v1/jobs/{job.pk}/rerun/", {"model": "secret-chat"}, format="json")
    missing = member.client.post(f"/api/v1/jobs/{job.pk}/rerun/", {"model": "no-such-chat"}, format="json")
    assert outside.status_code == missing.status_code == 400, outside.content
    assert _same_but_the_name(outside, missing, "secret-chat", "no-such-chat"), (outside.json(), missing.json())
    assert "chat" not in outside.json()["error"]["message"].replace("secret-chat", "")
    assert Job.objects.count() == 1


def test_distinct_record_model_names_cost_no_query_each_and_are_bounded_naming_the_line(
    settings: Any, caller: Callable[..., Caller], minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    settings.BATCHERY_MAX_RECORD_MODEL_NAMES = 10
    alice = caller("acme")
    few = write_jsonl([{"custom_id": f"r{n}", "input": "x", "model": f"unknown-{n}"} for n in range(10)], "few.jsonl")
    many = [{"custom_id": f"r{n}", "input": "x", "model": f"unknown-{n}"} for n in range(400)]
    with few.open("rb") as handle:
        small = alice.client.post("/api/v1/jobs/", {"file": handle, "model": minilm.name}, format="multipart")
    with CaptureQueriesContext(connection) as queries, write_jsonl(many, "many.jsonl").open("rb") as handle:
        large = alice.client.post("/api/v1/jobs/", {"file": handle, "model": minilm.name}, format="multipart")
    assert small.status_code == large.status_code == 400, large.content
    assert len(queries) < len(_queries_of(alice, few, minilm)) + 5, "400 names looked up one query each"
    lines = {problem["line"]: problem["message"] for problem in large.json()["error"]["lines"]}
    assert "neither the job's model" in lines[1]
    assert "distinct model name 11 of this job's records, over the limit of 10" in lines[11], lines
    assert "BATCHERY_MAX_RECORD_MODEL_NAMES" in lines[11]


def _queries_of(caller: Caller, path: Path, model: Model) -> list[Any]:
    with CaptureQueriesContext(connection) as queries, path.open("rb") as handle:
        caller.client.post("/api/v1/jobs/", {"file": handle, "model": model.name}, format="multipart")
    return list(queries)


def test_distinct_reply_formats_of_one_jobs_records_are_bounded_naming_the_line(
    settings: Any, caller: Callable[..., Caller], tiny_chat: Model, write_jsonl: Callable[..., Path]
) -> None:
    settings.BATCHERY_MAX_JOB_SCHEMAS = 2
    alice = caller("acme")

    def held_to(n: int) -> dict[str, Any]:
        schema = {"type": "object", "properties": {f"p{n}": {"type": "integer"}}}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}

    messages = [{"role": "user", "content": "hi"}]
    # The same format again and again counts once; records without one count none.
    same = [{"custom_id": f"r{n}", "messages": messages, "params": held_to(n % 2)} for n in range(6)]
    plain = [{"custom_id": "plain", "messages": messages}]
    third = [{"custom_id": "third", "messages": messages, "params": held_to(2)}]
    for records, status in ((same + plain, 201), (same + plain + third, 400)):
        with write_jsonl(records, f"{len(records)}.jsonl").open("rb") as handle:
            answer = alice.client.post("/api/v1/jobs/", {"file": handle, "model": tiny_chat.name}, format="multipart")
        assert answer.status_code == status, answer.content
    lines = {problem["line"]: problem["message"] for problem in answer.json()["error"]["lines"]}
    assert list(lines) == [8] and "BATCHERY_MAX_JOB_SCHEMAS" in lines[8], lines
