"""Creating a message batch, as Anthropic draws the line: what malforms the batch refuses it whole; a request
whose params cannot run is kept as a refused record that errors alone, and the others run."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from portal.anthropic_api.models import MessageBatch
from portal.anthropic_api.selectors import message_batch_object, message_batch_results
from portal.anthropic_api.services.batches import MessageBatchRefused, message_batch_create
from portal.catalog.models import Model
from portal.jobs.models import Job
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import ApiKey, Tenant
from tasks.shared.storage import store_for
from tests.factories import MembershipFactory, ModelFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db

NEGATIVE = "params.max_tokens: max_tokens must be a positive integer, not -1"


@pytest.fixture
def acme() -> tuple[Tenant, ApiKey]:
    tenant = TenantFactory(name="acme")
    user = UserFactory(username="alice")
    MembershipFactory(user=user, tenant=tenant)
    key, _ = apikey_create(tenant=tenant, user=user)
    return tenant, key


@pytest.fixture
def chat_model(db: None) -> Model:
    """A chat model in the catalog; nothing here runs it."""
    return ModelFactory(
        name="tiny-chat", engine=Model.Engine.TRANSFORMERS, task=Model.Task.CHAT, source="/nowhere", is_default=False
    )


def request(custom_id: str, **params: Any) -> dict[str, Any]:
    body = {"model": "tiny-chat", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **params}
    return {"custom_id": custom_id, "params": body}


def create(acme: tuple[Tenant, ApiKey], requests: Any) -> MessageBatch:
    tenant, key = acme
    return message_batch_create(tenant=tenant, api_key=key, user=None, requests=requests, version="2023-06-01")


def refusal(acme: tuple[Tenant, ApiKey], requests: Any) -> str:
    with pytest.raises(MessageBatchRefused) as refused:
        create(acme, requests)
    assert not MessageBatch.objects.exists() and not Job.objects.exists()
    return str(refused.value)


def stored(uri: str) -> list[dict[str, Any]]:
    with store_for(uri).open_read(uri) as source:
        return [orjson.loads(line) for line in source]


def test_a_request_whose_params_cannot_run_is_kept_as_a_refused_record_in_its_place_and_the_batch_is_created(
    acme: tuple[Tenant, ApiKey], chat_model: Model
) -> None:
    batch = create(acme, [request("a"), request("b", max_tokens=-1), request("c", max_tokens=4)])

    job = batch.job
    assert job is not None and job.model == chat_model and job.params == {"max_tokens": 8}
    assert batch.request_count == 3
    assert stored(job.input_uri) == [
        {"custom_id": "a", "messages": [{"role": "user", "content": "Hi"}]},
        {"custom_id": "b", "refused": NEGATIVE},
        {"custom_id": "c", "messages": [{"role": "user", "content": "Hi"}], "params": {"max_tokens": 4}},
    ]
    assert message_batch_object(batch)["request_counts"]["processing"] == 3


@pytest.mark.parametrize(
    ("bad", "refused"),
    [
        ({"max_tokens": None}, "params.max_tokens: is required"),
        ({"model": "gpt-9"}, "params.model: no enabled model or adapter named 'gpt-9'"),
        ({"model": "all-MiniLM-L6-v2"}, "params.model: model 'all-MiniLM-L6-v2' serves task 'embed'"),
        ({"top_k": 5}, "params.top_k: top_k is not a parameter"),
        ({"stop_sequences": [""]}, "params.stop_sequences: must be a list of non-empty strings"),
        ({"thinking": {"type": "enabled"}}, "params.thinking: is not a Messages API param served here"),
        ({"messages": [{"role": "system", "content": "x"}]}, "params.messages.0.role: must be 'user' or 'assistant'"),
        (
            {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"}},
            "params.tools: tools is not supported by the transformers engine",
        ),
    ],
)
def test_each_kind_of_bad_params_errors_its_request_alone_naming_the_field(
    acme: tuple[Tenant, ApiKey], chat_model: Model, bad: dict[str, Any], refused: str
) -> None:
    ModelFactory()  # the bundled embedding model, a model of another task

    batch = create(acme, [request("bad", **bad), request("good")])

    assert batch.job is not None
    record, good = stored(batch.job.input_uri)
    assert "messages" in good and set(record) == {"custom_id", "refused"}
    assert record["refused"].startswith(refused), record


def test_the_batch_runs_the_first_chat_model_named_and_a_request_naming_another_errors(
    acme: tuple[Tenant, ApiKey], chat_model: Model
) -> None:
    ModelFactory(name="other-chat", engine=Model.Engine.TRANSFORMERS, task=Model.Task.CHAT, is_default=False)

    batch = create(acme, [request("a", model="gpt-9"), request("b", max_tokens=4), request("c", model="other-chat")])

    assert batch.job is not None and batch.job.model == chat_model
    # The job's params are the first runnable request's, not the refused first one's.
    assert batch.job.params == {"max_tokens": 4}
    records = stored(batch.job.input_uri)
    assert records[0] == {"custom_id": "a", "refused": "params.model: no enabled model or adapter named 'gpt-9'"}
    assert records[2]["refused"].startswith("params.model: is 'other-chat', but requests.1 runs on 'tiny-chat'")


def test_model_names_past_the_limit_error_without_a_lookup(
    acme: tuple[Tenant, ApiKey], chat_model: Model, settings: Any, django_assert_max_num_queries: Any
) -> None:
    settings.BATCHERY_MAX_RECORD_MODEL_NAMES = 2
    requests = [request("a"), request("b", model="x-1"), *(request(f"n{n}", model=f"y-{n}") for n in range(50))]

    with django_assert_max_num_queries(40):
        batch = create(acme, requests)

    assert batch.job is not None
    records = stored(batch.job.input_uri)
    assert records[1]["refused"] == "params.model: no enabled model or adapter named 'x-1'"
    assert records[2]["refused"] == (
        "params.model: 'y-0' would be distinct model name 3 of this batch's requests, over the limit of 2 "
        "(BATCHERY_MAX_RECORD_MODEL_NAMES)"
    )


def test_a_batch_none_of_whose_requests_can_run_has_no_job_and_has_ended_each_request_errored(
    acme: tuple[Tenant, ApiKey], chat_model: Model
) -> None:
    batch = create(acme, [request("a", max_tokens=-1), request("b", model="gpt-9")])

    assert batch.job is None and not Job.objects.exists()
    shown = message_batch_object(batch)
    assert shown["processing_status"] == "ended" and shown["ended_at"] is not None
    assert shown["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 2, "canceled": 0, "expired": 0}
    results = [orjson.loads(line) for line in message_batch_results(batch)]
    assert results == [
        {"custom_id": "a", "result": _errored(NEGATIVE)},
        {"custom_id": "b", "result": _errored("params.model: no enabled model or adapter named 'gpt-9'")},
    ]


def _errored(message: str) -> dict[str, Any]:
    return {
        "type": "errored",
        "error": {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
    }


def test_duplicate_custom_ids_still_refuse_the_whole_batch_whatever_else_the_requests_hold(
    acme: tuple[Tenant, ApiKey], chat_model: Model
) -> None:
    message = refusal(acme, [request("a"), request("b", max_tokens=-1), request("b")])

    assert message == "requests.2.custom_id: 'b' is already the custom_id of requests.1; each request needs its own"


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ("not a list", "requests: must be a non-empty list"),
        ([], "requests: must be a non-empty list"),
        ([request("a"), "not an object"], "requests.1: must be an object {custom_id, params}"),
        ([request("a b")], "requests.0.custom_id: must be 1 to 64 characters"),
        ([{"params": request("a")["params"]}], "requests.0.custom_id: must be 1 to 64 characters"),
        ([request("a"), {"custom_id": "b"}], "requests.1.params: must be an object of Messages API params"),
        ([{"custom_id": "a", "params": []}], "requests.0.params: must be an object of Messages API params"),
        ([{**request("a"), "extra": 1}], "requests.0.extra: Extra inputs are not permitted"),
    ],
)
def test_a_malformed_envelope_still_refuses_the_whole_batch_naming_the_field(
    acme: tuple[Tenant, ApiKey], chat_model: Model, requests: Any, message: str
) -> None:
    assert refusal(acme, requests).startswith(message)
