"""`/v1/messages/batches`: Anthropic's Message Batches API over Batchery jobs, endpoint by endpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from portal.anthropic_api.models import MessageBatch
from portal.catalog.models import Adapter, Model
from portal.jobs.models import Job, JobStatus
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Membership, Quota
from tasks.shared.storage import store_for
from tests.api.conftest import Caller
from tests.factories import ModelFactory

VERSION = {"HTTP_ANTHROPIC_VERSION": "2023-06-01"}
URL = "/v1/messages/batches"


@pytest.fixture
def chat_model(db: None) -> Model:
    """A chat model in the catalog; nothing here runs it."""
    return ModelFactory(
        name="tiny-chat", engine=Model.Engine.TRANSFORMERS, task=Model.Task.CHAT, source="/nowhere", is_default=False
    )


def anthropic_client(key: str, *, header: str = "x-api-key") -> APIClient:
    client = APIClient()
    if header == "x-api-key":
        client.credentials(HTTP_X_API_KEY=key, **VERSION)
    else:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}", **VERSION)
    return client


def chat_request(custom_id: str, text: str = "Hi", **params: Any) -> dict[str, Any]:
    body = {"model": "tiny-chat", "max_tokens": 8, "messages": [{"role": "user", "content": text}], **params}
    return {"custom_id": custom_id, "params": body}


def create(client: APIClient, requests: list[dict[str, Any]]) -> Any:
    return client.post(URL, {"requests": requests}, format="json")


def error_of(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def end_job(batch_id: str, lines: list[dict[str, Any]], status: str = JobStatus.SUCCEEDED) -> Job:
    """End the batch's job as its merge would: its output written, its counts and status set."""
    job = MessageBatch.objects.get(pk=batch_id).job
    assert job is not None
    with store_for(job.output_uri).open_write(job.output_uri) as target:
        for line in lines:
            target.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
    failed = sum(1 for line in lines if line.get("error"))
    Job.objects.filter(pk=job.pk).update(
        status=status,
        shard_count=1,
        succeeded_records=len(lines) - failed,
        failed_records=failed,
        finished_at=timezone.now(),
    )
    job.refresh_from_db()
    return job


def test_a_batch_becomes_a_chat_job_whose_records_carry_their_own_params_where_they_differ(
    caller: Callable[..., Caller], chat_model: Model
) -> None:
    client = anthropic_client(caller("acme").key)

    response = create(
        client,
        [chat_request("a", system="Be brief."), chat_request("b", stop_sequences=["\n"], max_tokens=4)],
    )

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["id"].startswith("msgbatch_") and body["type"] == "message_batch"
    assert body["processing_status"] == "in_progress"
    assert body["request_counts"] == {"processing": 2, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    assert body["created_at"].endswith("Z") and body["results_url"] is None and body["ended_at"] is None
    batch = MessageBatch.objects.select_related("job").get(pk=body["id"])
    job = batch.job
    assert job is not None and job.model == chat_model and job.params == {"max_tokens": 8}
    assert job.deadline_at is not None and abs((job.deadline_at - batch.expires_at).total_seconds()) < 5
    with store_for(job.input_uri).open_read(job.input_uri) as source:
        records = [orjson.loads(line) for line in source]
    assert records == [
        {"custom_id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {
            "custom_id": "b",
            "messages": [{"role": "user", "content": "Hi"}],
            "params": {"max_tokens": 4, "stop": ["\n"]},
        },
    ]


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([], "requests: must be a non-empty list"),
        ([chat_request("a"), chat_request("a")], "requests.1.custom_id: 'a' is already the custom_id of requests.0"),
        ([chat_request("a"), ["not", "an", "object"]], "requests.1: must be an object {custom_id, params}"),
        ([chat_request("a"), {"custom_id": "b", "params": "x"}], "requests.1.params: must be an object"),
    ],
)
def test_a_malformed_batch_is_refused_with_400_naming_the_request_and_field(
    caller: Callable[..., Caller], chat_model: Model, requests: list[Any], message: str
) -> None:
    response = create(anthropic_client(caller("acme").key), requests)

    assert message in error_of(response, 400, "invalid_request_error")
    assert not MessageBatch.objects.exists() and not Job.objects.exists()


def results_of(client: APIClient, batch: dict[str, Any]) -> list[dict[str, Any]]:
    response = client.get(batch["results_url"])
    assert response.status_code == 200, response
    return [orjson.loads(line) for line in b"".join(response.streaming_content).splitlines()]  # type: ignore[attr-defined]


def test_a_request_whose_params_cannot_run_errors_alone_in_the_results_and_the_others_run(
    caller: Callable[..., Caller], chat_model: Model
) -> None:
    client = anthropic_client(caller("acme").key)

    response = create(client, [chat_request("a"), chat_request("b", max_tokens=-1), chat_request("c", top_k=5)])

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["request_counts"]["processing"] == 3
    job = MessageBatch.objects.select_related("job").get(pk=body["id"]).job
    assert job is not None
    with store_for(job.input_uri).open_read(job.input_uri) as source:
        refused = {line["custom_id"]: line["refused"] for line in map(orjson.loads, source) if "refused" in line}
    assert sorted(refused) == ["b", "c"]
    assert refused["b"] == "params.max_tokens: max_tokens must be a positive integer, not -1"
    assert refused["c"].startswith("params.top_k: top_k is not a parameter the transformers engine honours")
    # Ended as its slot writes a refused record: the error `invalid_request` with the refusal.
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    end_job(
        body["id"],
        [
            {"custom_id": "a", "response": {"text": "Yo", "finish_reason": "stop", "usage": usage}},
            *({"custom_id": key, "error": {"code": "invalid_request", "message": why}} for key, why in refused.items()),
        ],
        status=JobStatus.PARTIALLY_SUCCEEDED,
    )

    ended = client.get(f"{URL}/{body['id']}").json()
    lines = results_of(client, ended)

    assert ended["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 2, "canceled": 0, "expired": 0}
    assert [(line["custom_id"], line["result"]["type"]) for line in lines] == [
        ("a", "succeeded"),
        ("b", "errored"),
        ("c", "errored"),
    ]
    assert lines[1]["result"]["error"] == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": refused["b"]},
    }


def test_a_batch_of_one_request_of_a_model_of_another_task_ends_at_once_errored_naming_the_model(
    caller: Callable[..., Caller], db: None
) -> None:
    ModelFactory()  # the bundled embedding model
    client = anthropic_client(caller("acme").key)

    response = create(client, [chat_request("a", model="all-MiniLM-L6-v2")])

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["processing_status"] == "ended" and not Job.objects.exists()
    assert body["request_counts"]["errored"] == 1
    (line,) = results_of(client, body)
    assert line["result"]["error"]["error"]["message"].startswith(
        "params.model: model 'all-MiniLM-L6-v2' serves task 'embed'"
    )


def test_a_body_that_is_not_json_or_lacks_requests_is_refused(caller: Callable[..., Caller], chat_model: Model) -> None:
    client = anthropic_client(caller("acme").key)

    error_of(client.post(URL, "{not json", content_type="application/json"), 400, "invalid_request_error")
    assert "requests: Field required" in error_of(client.post(URL, {}, format="json"), 400, "invalid_request_error")


def test_a_quota_refusal_is_a_429_rate_limit_error(caller: Callable[..., Caller], chat_model: Model) -> None:
    acme = caller("acme")
    Quota.objects.filter(tenant=acme.tenant).update(max_concurrent_jobs=0)

    response = create(anthropic_client(acme.key), [chat_request("a")])

    error_of(response, 429, "rate_limit_error")
    assert not MessageBatch.objects.exists()


def test_the_version_header_is_required_and_must_be_one_served(caller: Callable[..., Caller], db: None) -> None:
    client = APIClient()
    client.credentials(HTTP_X_API_KEY=caller("acme").key)

    missing = error_of(client.get(URL), 400, "invalid_request_error")
    unknown = error_of(client.get(URL, HTTP_ANTHROPIC_VERSION="2022-01-01"), 400, "invalid_request_error")

    assert "anthropic-version" in missing and "2023-06-01" in missing and "2026-10-21" in missing
    assert "'2022-01-01'" in unknown
    assert client.get(URL, HTTP_ANTHROPIC_VERSION="2026-10-21").status_code == 200


def test_keys_are_taken_in_x_api_key_or_as_a_bearer_and_refused_in_anthropics_shape(
    caller: Callable[..., Caller], db: None
) -> None:
    key = caller("acme").key

    assert anthropic_client(key).get(URL).status_code == 200
    assert anthropic_client(key, header="bearer").get(URL).status_code == 200
    error_of(anthropic_client("bk_nope_nope").get(URL), 401, "authentication_error")
    nobody = APIClient()
    nobody.credentials(**VERSION)
    error_of(nobody.get(URL), 401, "authentication_error")


def test_a_viewer_reads_but_may_not_create(caller: Callable[..., Caller], chat_model: Model) -> None:
    viewer = anthropic_client(caller("acme", role=Membership.Role.VIEWER).key)

    assert viewer.get(URL).status_code == 200
    error_of(create(viewer, [chat_request("a")]), 403, "permission_error")


def test_a_batch_is_seen_only_through_the_key_that_created_it(caller: Callable[..., Caller], chat_model: Model) -> None:
    acme = caller("acme")
    creator = anthropic_client(acme.key)
    batch_id = create(creator, [chat_request("a")]).json()["id"]
    _, other_key = apikey_create(tenant=acme.tenant, user=acme.user)
    others = [anthropic_client(other_key), anthropic_client(caller("globex").key)]

    assert creator.get(f"{URL}/{batch_id}").status_code == 200
    for other in others:
        error_of(other.get(f"{URL}/{batch_id}"), 404, "not_found_error")
        error_of(other.post(f"{URL}/{batch_id}/cancel"), 404, "not_found_error")
        error_of(other.delete(f"{URL}/{batch_id}"), 404, "not_found_error")
        error_of(other.get(f"{URL}/{batch_id}/results"), 404, "not_found_error")
        assert other.get(URL).json()["data"] == []


def test_the_list_pages_newest_first_before_and_after_an_id(caller: Callable[..., Caller], chat_model: Model) -> None:
    client = anthropic_client(caller("acme").key)
    ids = [create(client, [chat_request("a")]).json()["id"] for _ in range(5)]
    newest_first = ids[::-1]

    first = client.get(URL, {"limit": 2}).json()
    after = client.get(URL, {"limit": 2, "after_id": first["last_id"]}).json()
    before = client.get(URL, {"limit": 2, "before_id": newest_first[4]}).json()

    assert [batch["id"] for batch in first["data"]] == newest_first[:2] and first["has_more"] is True
    assert first["first_id"] == newest_first[0] and first["last_id"] == newest_first[1]
    assert [batch["id"] for batch in after["data"]] == newest_first[2:4] and after["has_more"] is True
    assert [batch["id"] for batch in before["data"]] == newest_first[2:4] and before["has_more"] is True
    assert "limit" in error_of(client.get(URL, {"limit": 0}), 400, "invalid_request_error")


def test_cancel_stops_the_job_and_a_batch_that_ended_cannot_be_cancelled(
    caller: Callable[..., Caller], chat_model: Model
) -> None:
    client = anthropic_client(caller("acme").key)
    batch_id = create(client, [chat_request("a")]).json()["id"]

    cancelled = client.post(f"{URL}/{batch_id}/cancel")

    assert cancelled.status_code == 200, cancelled.content
    body = cancelled.json()
    # Never started: its job is cancelled at once.
    assert body["processing_status"] == "ended" and body["cancel_initiated_at"] is not None
    assert MessageBatch.objects.get(pk=batch_id).job.status == JobStatus.CANCELLED  # type: ignore[union-attr]
    assert body["request_counts"]["canceled"] == 1
    results = client.get(body["results_url"])
    assert orjson.loads(b"".join(results.streaming_content)) == {"custom_id": "a", "result": {"type": "canceled"}}  # type: ignore[attr-defined]
    assert "cancelled" in error_of(client.post(f"{URL}/{batch_id}/cancel"), 400, "invalid_request_error")


def test_results_come_once_ended_one_line_a_request_and_counts_follow_them(
    caller: Callable[..., Caller], chat_model: Model
) -> None:
    client = anthropic_client(caller("acme").key)
    batch_id = create(client, [chat_request("a"), chat_request("b"), chat_request("c")]).json()["id"]
    assert "in_progress" in error_of(client.get(f"{URL}/{batch_id}/results"), 400, "invalid_request_error")
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    end_job(
        batch_id,
        [
            {"custom_id": "a", "response": {"text": "Yo", "finish_reason": "length", "usage": usage}},
            {"custom_id": "b", "error": {"code": "input_too_long", "message": "the prompt is too long"}},
            {"custom_id": "c", "error": {"code": "out_of_memory", "message": "no room"}},
        ],
        status=JobStatus.PARTIALLY_SUCCEEDED,
    )

    batch = client.get(f"{URL}/{batch_id}").json()
    results = client.get(batch["results_url"])

    assert batch["processing_status"] == "ended" and batch["ended_at"] is not None
    assert batch["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 2, "canceled": 0, "expired": 0}
    assert batch["results_url"] == f"http://testserver{URL}/{batch_id}/results"
    assert results.status_code == 200
    lines = [orjson.loads(line) for line in b"".join(results.streaming_content).splitlines()]  # type: ignore[attr-defined]
    assert [line["custom_id"] for line in lines] == ["a", "b", "c"]
    assert lines[0]["result"]["message"]["stop_reason"] == "max_tokens"
    assert lines[1]["result"]["error"]["error"]["type"] == "invalid_request_error"
    assert lines[2]["result"]["error"]["error"]["type"] == "api_error"


def test_only_an_ended_batch_is_deleted_and_its_stored_objects_go_with_it(
    caller: Callable[..., Caller], chat_model: Model, django_capture_on_commit_callbacks: Any
) -> None:
    client = anthropic_client(caller("acme").key)
    batch_id = create(client, [chat_request("a")]).json()["id"]
    assert "in_progress" in error_of(client.delete(f"{URL}/{batch_id}"), 400, "invalid_request_error")
    job = end_job(batch_id, [{"custom_id": "a", "error": {"code": "engine_error", "message": "no"}}])

    with django_capture_on_commit_callbacks(execute=True):
        deleted = client.delete(f"{URL}/{batch_id}")

    assert deleted.json() == {"id": batch_id, "type": "message_batch_deleted"}
    assert not MessageBatch.objects.filter(pk=batch_id).exists()
    assert Job.objects.filter(pk=job.pk).exists()  # the job and its usage stay
    for uri in (job.input_uri, job.output_uri):
        assert not store_for(uri).exists(uri)
    error_of(client.get(f"{URL}/{batch_id}"), 404, "not_found_error")


def test_an_unknown_batch_is_a_404_in_anthropics_shape(caller: Callable[..., Caller], db: None) -> None:
    client = anthropic_client(caller("acme").key)

    assert "msgbatch_nope" in error_of(client.get(f"{URL}/msgbatch_nope"), 404, "not_found_error")


def test_requests_may_name_adapters_of_the_batchs_model_and_run_on_it_but_not_another_model(
    caller: Callable[..., Caller], chat_model: Model
) -> None:
    acme = caller("acme")
    Adapter.objects.create(name="support-bot", base_model=chat_model, owner=acme.tenant, source="/a", rank=4)
    ModelFactory(name="other-chat", engine=Model.Engine.TRANSFORMERS, task=Model.Task.CHAT, is_default=False)
    client = anthropic_client(acme.key)

    response = create(client, [chat_request("a", model="support-bot"), chat_request("b")])

    assert response.status_code == 200, response.content
    job = MessageBatch.objects.select_related("job__model").get(pk=response.json()["id"]).job
    assert job is not None and job.model == chat_model
    assert sorted(job.adapters) == ["support-bot"]
    with store_for(job.input_uri).open_read(job.input_uri) as source:
        assert [orjson.loads(line).get("model") for line in source] == ["support-bot", None]
    mixed = create(client, [chat_request("a", model="support-bot"), chat_request("b", model="other-chat")])
    assert mixed.status_code == 200, mixed.content
    job = MessageBatch.objects.select_related("job").get(pk=mixed.json()["id"]).job
    assert job is not None
    with store_for(job.input_uri).open_read(job.input_uri) as source:
        refused = [orjson.loads(line).get("refused") for line in source]
    assert refused[0] is None
    assert refused[1].startswith("params.model: is 'other-chat', but requests.0 runs on 'tiny-chat'")
    stranger = anthropic_client(caller("globex").key)
    (line,) = results_of(stranger, create(stranger, [chat_request("a", model="support-bot")]).json())
    assert "no enabled model or adapter named 'support-bot'" in line["result"]["error"]["error"]["message"]
