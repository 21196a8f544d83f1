"""A chat record naming media by URL is refused at submission on all three APIs (REST, OpenAI batches, Anthropic
message batches, where the request errors alone as Anthropic's do), naming the line and the part; inline media is
taken for a model whose catalog entry says it takes that kind of input; and a record's own schema over the bounds is
refused naming the line and the field."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from portal.anthropic_api.models import MessageBatch
from portal.catalog.models import Model
from portal.jobs.models import Job
from tasks.shared.storage import store_for
from tests.api.conftest import Caller
from tests.factories import ModelFactory

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
INLINE_IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture
def vision_chat(db: None) -> Model:
    """A chat model on vLLM; nothing here runs it. Text only, as a catalog entry is by default."""
    return ModelFactory(
        name="vision-chat", engine=Model.Engine.VLLM, task=Model.Task.CHAT, source="/nowhere", is_default=False
    )


def image_messages(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def submit_rest(caller: Caller, records: list[dict[str, Any]], model: str = "vision-chat") -> Any:
    handle = io.BytesIO(b"".join(json.dumps(record).encode() + b"\n" for record in records))
    handle.name = "records.jsonl"
    return caller.client.post("/api/v1/jobs/", {"file": handle, "model": model}, format="multipart")


def test_rest_refuses_a_record_naming_a_metadata_address_naming_the_line_and_part(
    caller: Callable[..., Caller], vision_chat: Model
) -> None:
    fine = {"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]}
    response = submit_rest(caller("acme"), [fine, {"custom_id": "b", "messages": image_messages(METADATA)}])

    assert response.status_code == 400, response.content
    text = json.dumps(response.json())
    assert "line 2: messages[0].content[1].image_url.url is 'http://169.254.169.254/" in text
    assert "slots fetch nothing a record names" in text
    assert not Job.objects.exists()


def test_rest_takes_inline_media_only_for_a_model_that_takes_its_kind(
    caller: Callable[..., Caller], vision_chat: Model
) -> None:
    alice = caller("acme")
    record = {"custom_id": "a", "messages": image_messages(INLINE_IMAGE)}

    refused = submit_rest(alice, [record])
    assert refused.status_code == 400, refused.content
    assert "which this model does not accept; it takes text" in json.dumps(refused.json())

    Model.objects.filter(pk=vision_chat.pk).update(input_modalities=["text", "image"])
    accepted = submit_rest(alice, [record])
    assert accepted.status_code == 201, accepted.content


def test_the_catalog_says_what_a_model_takes(caller: Callable[..., Caller], vision_chat: Model) -> None:
    models = caller("acme").client.get("/api/v1/models/").json()
    entry = next(model for model in models if model["name"] == "vision-chat")
    assert entry["input_modalities"] == ["text"]


def test_rest_refuses_a_records_own_schema_over_the_bounds_naming_the_line_and_field(
    caller: Callable[..., Caller], vision_chat: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_DEPTH", "6")
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(10):
        schema = {"type": "object", "properties": {"a": schema}}
    params = {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    record = {"custom_id": "a", "messages": [{"role": "user", "content": "hi"}], "params": params}

    response = submit_rest(caller("acme"), [record])

    assert response.status_code == 400, response.content
    assert "line 1: params.response_format.json_schema.schema nests deeper than 6 levels" in json.dumps(response.json())


def test_a_jobs_schema_over_the_bounds_is_refused_naming_params(
    caller: Callable[..., Caller], vision_chat: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_PROPERTIES", "2")
    schema = {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}}
    params = {"response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}}
    handle = io.BytesIO(b'{"messages": [{"role": "user", "content": "hi"}]}\n')
    handle.name = "records.jsonl"

    response = caller("acme").client.post(
        "/api/v1/jobs/", {"file": handle, "model": "vision-chat", "params": json.dumps(params)}, format="multipart"
    )

    assert response.status_code == 400, response.content
    assert "params.response_format.json_schema.schema has more than 2 properties" in json.dumps(response.json())


def openai_batch(caller: Caller, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    lines = [
        {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for n, body in enumerate(bodies)
    ]
    handle = io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    handle.name = "requests.jsonl"
    file_id = caller.client.post("/v1/files", {"file": handle, "purpose": "batch"}, format="multipart").json()["id"]
    response = caller.client.post(
        "/v1/batches",
        {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        format="json",
    )
    assert response.status_code == 200, response.content
    return dict(response.json())


def test_openai_batches_fail_a_line_naming_a_private_address_naming_the_line_and_part(
    caller: Callable[..., Caller], vision_chat: Model
) -> None:
    Model.objects.filter(pk=vision_chat.pk).update(input_modalities=["text", "image"])
    hi = {"model": "vision-chat", "messages": [{"role": "user", "content": "hi"}]}
    batch = openai_batch(caller("acme"), [hi, {"model": "vision-chat", "messages": image_messages("http://10.0.0.1/")}])

    assert batch["status"] == "failed"
    [error] = batch["errors"]["data"]
    assert error["line"] == 2 and error["code"] == "invalid_input"
    assert error["param"] == "body.messages[0].content[1].image_url.url"
    assert error["message"].startswith("body.messages[0].content[1].image_url.url is 'http://10.0.0.1/'")
    assert not Job.objects.exists()


def test_openai_batches_refuse_media_the_model_does_not_take_and_take_it_where_it_does(
    caller: Callable[..., Caller], vision_chat: Model
) -> None:
    alice = caller("acme")
    body = {"model": "vision-chat", "messages": image_messages(INLINE_IMAGE)}
    refused = openai_batch(alice, [body])
    assert refused["status"] == "failed"
    assert "which this model does not accept" in refused["errors"]["data"][0]["message"]

    Model.objects.filter(pk=vision_chat.pk).update(input_modalities=["text", "image"])
    assert openai_batch(alice, [body])["status"] != "failed"


def anthropic_batch(caller: Caller, content: list[dict[str, Any]], system: str | None = None) -> Any:
    client = caller.client
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {caller.key}", HTTP_ANTHROPIC_VERSION="2023-06-01")
    body: dict[str, Any] = {"model": "vision-chat", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
    if system is not None:
        body["system"] = system
    return client.post("/v1/messages/batches", {"requests": [{"custom_id": "a", "params": body}]}, format="json")


def refusal(caller: Caller, response: Any) -> str:
    """The message of the batch's one request, errored at creation: the batch has ended with no job to run it."""
    assert response.status_code == 200, response.content
    batch = response.json()
    assert batch["processing_status"] == "ended" and not Job.objects.exists()
    results = caller.client.get(batch["results_url"])
    [line] = [json.loads(line) for line in b"".join(results.streaming_content).splitlines()]
    assert line["result"]["type"] == "errored"
    error = line["result"]["error"]["error"]
    assert error["type"] == "invalid_request_error"
    return str(error["message"])


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (
            {"type": "image", "source": {"type": "url", "url": METADATA}},
            "params.messages.0.content.1.source.type: image sources of type 'url' are not served here: "
            "GPU hosts fetch nothing a request names",
        ),
        (
            {"type": "document", "source": {"type": "url", "url": "http://127.0.0.1:8000/"}},
            "params.messages.0.content.1.type: content blocks of type 'document' are not served here",
        ),
    ],
)
def test_anthropic_batches_error_a_request_of_media_by_url_or_documents_naming_the_block(
    caller: Callable[..., Caller], vision_chat: Model, block: dict[str, Any], expected: str
) -> None:
    Model.objects.filter(pk=vision_chat.pk).update(input_modalities=["text", "image"])
    alice = caller("acme")
    response = anthropic_batch(alice, [{"type": "text", "text": "What is it?"}, block])
    assert refusal(alice, response).startswith(expected)


def test_anthropic_batches_take_an_inline_image_only_for_a_model_that_takes_images(
    caller: Callable[..., Caller], vision_chat: Model
) -> None:
    alice = caller("acme")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    content = [{"type": "text", "text": "What is it?"}, image]

    message = refusal(alice, anthropic_batch(alice, content, system="Be brief."))
    assert message == (
        "params.messages.0.content.1: is image input ('image_url'), which this model does not accept; it takes text"
    )

    Model.objects.filter(pk=vision_chat.pk).update(input_modalities=["text", "image"])
    accepted = anthropic_batch(alice, content, system="Be brief.")
    assert accepted.status_code == 200, accepted.content
    job = MessageBatch.objects.get(pk=accepted.json()["id"]).job
    assert job is not None
    with store_for(job.input_uri).open_read(job.input_uri) as source:
        [record] = [json.loads(line) for line in source]
    assert record["messages"][1]["content"] == [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
