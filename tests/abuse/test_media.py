"""Attacks through chat media and structured output: records whose media URLs name a metadata service or a private
address, on all three APIs, and schemas too large to compile on a shared slot. Each is refused at submission naming
the line and the part (or field; an Anthropic request errors alone, as Anthropic's do), and the listener standing for
the private address sees no request."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from portal.catalog.models import Model
from tests.abuse.conftest import scale
from tests.factories import ModelFactory
from tests.support.abuse import AbuseResult, AbuseStack
from tests.support.media import Listener

pytestmark = [pytest.mark.slow, pytest.mark.abuse]

CHAT_MODEL = "abuse-vision-chat"


@pytest.fixture(scope="module")
def vision_chat(abuse_stack: AbuseStack) -> str:
    """A chat model that takes images, on vLLM; no slot runs it: every attack here is refused before one would."""
    with abuse_stack.db():
        if not Model.objects.filter(name=CHAT_MODEL).exists():
            ModelFactory(
                name=CHAT_MODEL,
                engine=Model.Engine.VLLM,
                task=Model.Task.CHAT,
                source="/nowhere",
                is_default=False,
                input_modalities=["text", "image"],
            )
    return CHAT_MODEL


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def image_messages(url: str) -> list[dict[str, Any]]:
    part = {"type": "image_url", "image_url": {"url": url}}
    return [{"role": "user", "content": [{"type": "text", "text": "describe"}, part]}]


def addresses(listener: Listener) -> list[str]:
    return [
        f"{listener.url}/latest/meta-data/iam/security-credentials/",
        "http://169.254.169.254/latest/meta-data/",
        "https://metadata.google.internal/computeMetadata/v1/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "file:///etc/passwd",
    ]


def wait_batch_ended(client: Any, batch_id: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] in ("validating",):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return dict(batch)


def test_media_urls_naming_private_addresses_are_refused_on_every_api_and_never_fetched(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], vision_chat: str, listener: Listener
) -> None:
    attacker = abuse_stack.tenant("media-attacker")
    rounds = scale(2, 10)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            for _ in range(rounds):
                for url in addresses(listener):
                    records = [
                        {"custom_id": "ok", "messages": [{"role": "user", "content": "hi"}]},
                        {"custom_id": "ssrf", "messages": image_messages(url)},
                    ]
                    body = b"".join(orjson.dumps(record) + b"\n" for record in records)
                    rest = client.post(
                        "/api/v1/jobs/", data={"model": vision_chat}, files={"file": ("m.jsonl", io.BytesIO(body))}
                    )
                    assert rest.status_code == 400, rest.text
                    assert "line 2: messages[0].content[1].image_url.url is " in rest.json()["error"]["message"]

                    # Padded past BATCHERY_BATCH_SYNC_VALIDATION_BYTES: the validation worker judges it.
                    lines = [
                        {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": vision_chat, "messages": [{"role": "user", "content": "x" * 200}]}}
                        for n in range(8)
                    ]  # fmt: skip
                    lines.append(
                        {"custom_id": "ssrf", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": vision_chat, "messages": image_messages(url)}}
                    )  # fmt: skip
                    upload = b"".join(orjson.dumps(line) + b"\n" for line in lines)
                    file_id = client.post(
                        "/v1/files", data={"purpose": "batch"}, files={"file": ("b.jsonl", io.BytesIO(upload))}
                    ).json()["id"]
                    created = client.post(
                        "/v1/batches",
                        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
                    )
                    assert created.status_code == 200, created.text
                    batch = wait_batch_ended(client, created.json()["id"])
                    assert batch["status"] == "failed", batch
                    [error] = batch["errors"]["data"]
                    assert error["line"] == 9 and error["param"].startswith("body.messages[0].content[1]"), error

                    block = {"type": "image", "source": {"type": "url", "url": url}}
                    content = [{"type": "text", "text": "hi"}, block]
                    params = {"model": vision_chat, "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
                    anthropic = client.post(
                        "/v1/messages/batches",
                        json={"requests": [{"custom_id": "a", "params": params}]},
                        headers={"anthropic-version": "2023-06-01"},
                    )
                    # As Anthropic answers it, the batch is created and the request errors alone: here the only
                    # one, so the batch has no job and has ended at once.
                    assert anthropic.status_code == 200, anthropic.text
                    assert anthropic.json()["processing_status"] == "ended", anthropic.text
                    results = client.get(anthropic.json()["results_url"], headers={"anthropic-version": "2023-06-01"})
                    [line] = [orjson.loads(raw) for raw in results.content.splitlines()]
                    assert line["result"]["type"] == "errored", line
                    assert line["result"]["error"]["error"]["message"].startswith(
                        "params.messages.0.content.1.source.type: image sources of type 'url'"
                    )
        assert listener.paths == [], listener.paths
        return (
            f"{rounds * len(addresses(listener))} x 3 APIs: REST 400 (line 2), OpenAI batch failed (line 9), "
            "Anthropic errored alone; the listener saw no request"
        )

    abuse_report("media URLs naming private and metadata addresses", attack)


def test_schemas_too_large_to_compile_on_a_slot_are_refused_naming_the_field(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], vision_chat: str
) -> None:
    attacker = abuse_stack.tenant("schema-attacker")
    # Written out: JSON encoders refuse to nest this deep, the tenant's own tools need not.
    deep = b'{"type":"object","properties":{"a":' * 400 + b'{"type":"string"}' + b"}}" * 400
    # Within a job's params' own bounds (64 KiB, 32 levels): only the schema's bound refuses it.
    wide = {"type": "object", "properties": {f"p{n}": {"type": "integer"} for n in range(1500)}}
    huge = {"type": "object", "properties": {f"p{n}": {"type": "integer"} for n in range(20000)}}
    # Small, but a grammar backend would fetch what it refers to from the GPU host.
    remote = {"type": "object", "properties": {"a": {"$ref": "http://169.254.169.254/latest/meta-data/"}}}
    attempts = scale(3, 20)

    def response_format(schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}

    def attack() -> str:
        chat = b'{"messages": [{"role": "user", "content": "hi"}]}\n'
        with abuse_stack.api(attacker) as client:
            for _ in range(attempts):
                params = orjson.dumps({"response_format": response_format(wide)}).decode()
                job = client.post(
                    "/api/v1/jobs/",
                    data={"model": vision_chat, "params": params},
                    files={"file": ("s.jsonl", io.BytesIO(chat))},
                )
                assert job.status_code == 400, job.text
                assert "params.response_format.json_schema.schema has more than 1000 properties" in job.text
                for schema in (deep, orjson.dumps(huge), orjson.dumps(remote)):
                    record = (
                        b'{"messages": [{"role": "user", "content": "hi"}], "params": {"response_format": '
                        b'{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + schema + b"}}}}\n"
                    )
                    own = client.post(
                        "/api/v1/jobs/", data={"model": vision_chat}, files={"file": ("s.jsonl", io.BytesIO(record))}
                    )
                    assert own.status_code == 400, own.text
                    assert "line 1: params.response_format.json_schema.schema" in own.json()["error"]["message"]
        return (
            f"{attempts} x 1,500 properties (job), 400 levels, 20,000 properties and a $ref to a metadata URL "
            "(record): 400 naming the field"
        )

    abuse_report("json_schema too large to compile, or referring to a URL", attack)
