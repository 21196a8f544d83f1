"""The official `anthropic` client, unchanged, against a live stack: a message batch runs as a Batchery job on
real workers with a tiny chat model, a request with bad params errors alone, and its results, cancel, delete and
scoping read as Anthropic's."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from portal.catalog.models import Model
from portal.tenancy.apikeys import apikey_create
from tests.api.conftest import Caller

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def anthropic_client(live_server: Any, key: str) -> anthropic.Anthropic:
    """The client as a user builds it, pointed at ``live_server``; no retries, so a bad answer shows."""
    return anthropic.Anthropic(api_key=key, base_url=live_server.url, max_retries=0, timeout=60)


def wait_until_ended(
    client: anthropic.Anthropic, batch_id: str, workers: dict[str, Any], timeout_s: float = 180
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.3)
    logs = "\n".join(f"--- {name}\n{worker.log_tail()}" for name, worker in workers.items())
    raise AssertionError(f"message batch {batch_id} still {batch.processing_status} after {timeout_s}s\n{logs}")


def request(custom_id: str, text: str) -> dict[str, Any]:
    params = {"model": "tiny-chat", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
    return {"custom_id": custom_id, "params": params}


def test_the_anthropic_sdk_runs_a_message_batch_end_to_end_and_sees_only_its_own_batches(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], tiny_chat: Model
) -> None:
    acme = caller("acme")
    client = anthropic_client(live_server, acme.key)

    # A negative max_tokens is that request's fault alone, as at Anthropic: the batch is created, the request errors
    # without running. The tiny model has 128 positions: a prompt of 300 characters is refused by the engine, for
    # that record only.
    bad = request("bad", "Hi?")
    bad["params"]["max_tokens"] = -1
    created = client.messages.batches.create(
        requests=[request("short", "Hi?"), bad, request("long", "x" * 300), request("other", "Bye?")]
    )
    assert created.id.startswith("msgbatch_") and created.processing_status == "in_progress"
    assert created.request_counts.processing == 4
    batch = wait_until_ended(client, created.id, pipeline_workers)

    assert batch.request_counts.succeeded == 2 and batch.request_counts.errored == 2
    assert batch.ended_at is not None and batch.results_url is not None
    assert [listed.id for listed in client.messages.batches.list()] == [batch.id]
    lines = list(client.messages.batches.results(batch.id))
    assert [line.custom_id for line in lines] == ["short", "bad", "long", "other"]
    results = {line.custom_id: line.result for line in lines}
    assert results["short"].type == "succeeded" and results["other"].type == "succeeded"
    assert results["bad"].type == "errored"
    assert results["bad"].error.type == "error" and results["bad"].error.error.type == "invalid_request_error"
    assert results["bad"].error.error.message == "params.max_tokens: max_tokens must be a positive integer, not -1"
    message = results["short"].message
    assert message.model == "tiny-chat" and message.role == "assistant"
    assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= 5
    assert results["long"].type == "errored"
    assert results["long"].error.error.type == "invalid_request_error"

    # Cancelled at once: it ends canceled, whether or not a record ran.
    to_cancel = client.messages.batches.create(requests=[request(f"r{n}", f"Question {n}?") for n in range(4)])
    cancelling = client.messages.batches.cancel(to_cancel.id)
    assert cancelling.processing_status in ("canceling", "ended")
    assert cancelling.cancel_initiated_at is not None
    cancelled = wait_until_ended(client, to_cancel.id, pipeline_workers)
    counts = cancelled.request_counts
    assert counts.canceled + counts.succeeded == 4 and counts.canceled >= 1
    outcomes = {line.result.type for line in client.messages.batches.results(to_cancel.id)}
    assert "canceled" in outcomes and outcomes <= {"canceled", "succeeded"}

    # Neither another tenant's key nor the tenant's other key sees anything of it.
    _, other_key = apikey_create(tenant=acme.tenant, user=acme.user)
    for stranger in (anthropic_client(live_server, other_key), anthropic_client(live_server, caller("globex").key)):
        with pytest.raises(anthropic.NotFoundError):
            stranger.messages.batches.retrieve(batch.id)
        with pytest.raises(anthropic.NotFoundError):
            stranger.messages.batches.delete(batch.id)
        assert list(stranger.messages.batches.list()) == []

    deleted = client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    assert [listed.id for listed in client.messages.batches.list()] == [to_cancel.id]
