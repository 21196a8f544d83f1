"""Webhooks end to end through the real workers: a job's ending is committed here, the control worker
finalizes the batch and emits the event, the webhooks worker delivers it (again, after a delay, when the
receiver fails); a slow receiver delays only its own tenant's deliveries."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from standardwebhooks import Webhook

from portal.jobs.models import Job, JobStatus
from portal.jobs.transitions import job_transition
from portal.openai_api.models import Batch
from portal.tenancy.models import Tenant
from portal.webhooks.models import DeliveryStatus, WebhookDelivery
from tests.support.workers import WorkerProcess
from tests.webhooks.conftest import Receiver, endpoint_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
def webhooks_worker(pipeline_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    """The session's webhooks worker, which delivers to 127.0.0.1 and retries fast (`tests/conftest.py`):
    a worker of this module's own would share the webhooks queue with it, which would take deliveries."""
    return pipeline_workers["webhooks"]


def _end(job: Job) -> None:
    """Walk the job to `succeeded` as the pipeline does, each step its own committed transaction."""
    current = job.status
    for status in (JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.MERGING, JobStatus.SUCCEEDED):
        assert job_transition(job_id=str(job.pk), source=current, target=status)
        current = status


def _settled(delivery_filter: dict[str, Any], worker: WorkerProcess, timeout_s: float = 30.0) -> WebhookDelivery:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        delivery = WebhookDelivery.objects.filter(**delivery_filter).first()
        if delivery is not None and delivery.status != DeliveryStatus.PENDING:
            return delivery
        time.sleep(0.1)
    raise AssertionError(f"no settled delivery for {delivery_filter}\n{worker.log_tail()}")


def test_a_receiver_on_127_0_0_1_gets_batch_completed_once_signed(
    webhooks_worker: WorkerProcess, acme: Tenant, minilm: Any, settings: Any, receiver: Callable[..., Receiver]
) -> None:
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    server = receiver()
    endpoint = endpoint_for(acme, server.url, "batch.completed", "job.completed")
    job = Job.objects.create(tenant=acme, model=minilm, input_uri="file:///x.jsonl")
    batch = Batch.objects.create(
        id="batch_webhook0000000000000001",
        tenant=acme,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id="file-x",
        job=job,
    )
    _end(job)

    [request] = server.wait_for(1)
    event = Webhook(endpoint.secret).verify(request.body, request.headers)
    assert (event["type"], event["data"], event["object"]) == ("batch.completed", {"id": batch.id}, "event")
    delivery = _settled({"event_id": event["id"]}, webhooks_worker)
    assert (delivery.status, delivery.attempt_count) == (DeliveryStatus.DELIVERED, 1)
    batch.refresh_from_db()
    assert batch.finalized_at is not None
    time.sleep(1.5)  # a second message, had one been sent, would have arrived by now
    assert len(server.requests()) == 1, "once: no job.completed for a batch's job, no second delivery"


def test_a_receiver_that_fails_twice_gets_the_event_on_the_third_attempt(
    webhooks_worker: WorkerProcess, acme: Tenant, minilm: Any, settings: Any, receiver: Callable[..., Receiver]
) -> None:
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    server = receiver(500, 502)
    endpoint = endpoint_for(acme, server.url, "job.completed")
    job = Job.objects.create(tenant=acme, model=minilm, input_uri="file:///x.jsonl")
    _end(job)

    requests = server.wait_for(3)
    events = [Webhook(endpoint.secret).verify(request.body, request.headers) for request in requests]
    assert {event["id"] for event in events} == {events[0]["id"]}
    assert events[0]["type"] == "job.completed" and events[0]["data"]["id"] == str(job.pk)
    delivery = _settled({"event_id": events[0]["id"]}, webhooks_worker)
    assert delivery.status == DeliveryStatus.DELIVERED
    assert list(delivery.attempts.values_list("number", "status_code")) == [(1, 500), (2, 502), (3, 200)]
    assert len(server.requests()) == 3
