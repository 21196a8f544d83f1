"""A hostile receiver through the real workers: deliveries run on the `webhooks` queue's own worker, an
attempt ends at its deadline, a tenant's attempts in flight are capped, and nothing of it reaches the
control lane or another tenant's deliveries. Its URL's token never reaches the logs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from portal.jobs.models import JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Tenant
from portal.webhooks.models import DeliveryStatus, WebhookAttempt, WebhookDelivery
from portal.webhooks.services.endpoints import webhook_endpoint_set_enabled
from portal.webhooks.services.events import webhook_event_emit
from tests.factories import TenantFactory
from tests.support.jobs import wait_for_job
from tests.support.workers import WorkerProcess, wait_until_idle
from tests.webhooks.conftest import Receiver, TrickleReceiver, endpoint_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

DEADLINE_S = 4.0  # BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S of the session's workers (`tests/conftest.py`)


def _wait(predicate: Callable[[], bool], what: str, worker: WorkerProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout_s} s\n{worker.log_tail()}")


def test_a_trickling_receiver_delays_only_its_own_tenants_deliveries(
    pipeline_workers: dict[str, WorkerProcess],
    acme: Tenant,
    minilm: Any,
    settings: Any,
    trickle: Callable[[], TrickleReceiver],
    receiver: Callable[..., Receiver],
    write_jsonl: Callable[..., Path],
) -> None:
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    webhooks = pipeline_workers["webhooks"]
    slow, fast = trickle(), receiver()
    hostile = endpoint_for(acme, slow.url("/hooks/tok-SECRET1?key=SECRET2"), "job.completed")
    webhook_event_emit(tenant_id=acme.pk, event_type="job.completed", data={"id": "a-1"})
    webhook_event_emit(tenant_id=acme.pk, event_type="job.completed", data={"id": "a-2"})
    slow.wait_for_connections(1)

    # Another tenant's delivery goes out while the hostile receiver trickles.
    globex = TenantFactory(name="globex")
    endpoint_for(globex, fast.url, "job.completed")
    webhook_event_emit(tenant_id=globex.pk, event_type="job.completed", data={"id": "g-1"})
    fast.wait_for(1, timeout_s=60)
    assert slow.dropped == [], "the other tenant's delivery waited for the slow attempt to end"

    # And a job's plan, shards, settle and merge on the control lane.
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(3)])
    job = job_submit(tenant=globex, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    submitted = time.monotonic()
    job = wait_for_job(job, timeout_s=120, workers=pipeline_workers)
    assert job.status == JobStatus.SUCCEEDED, job.error
    job_took = time.monotonic() - submitted

    # The slow attempt ended at its deadline, and the tenant's second delivery waited for its place.
    _wait(lambda: WebhookAttempt.objects.filter(delivery__endpoint=hostile).count() >= 2, "two attempts", webhooks)
    first = WebhookAttempt.objects.filter(delivery__endpoint=hostile).order_by("started_at").first()
    assert first is not None and "deadline" in first.error and first.status_code is None
    assert first.duration_ms < (DEADLINE_S + 2) * 1000, first.duration_ms
    spans = [
        (attempt.started_at.timestamp(), attempt.started_at.timestamp() + attempt.duration_ms / 1000)
        for attempt in WebhookAttempt.objects.filter(delivery__endpoint=hostile).order_by("started_at")
    ]
    overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1] - 0.05]
    assert overlaps == [], "two attempts of one tenant were in flight at once"
    assert job_took < 30, f"the 3-record job took {job_took:.1f} s beside a trickling receiver"

    # The rest fail at once, so that the workers are idle for the next test; then the logs are read.
    webhook_endpoint_set_enabled(endpoint=hostile, enabled=False)
    _wait(
        lambda: not WebhookDelivery.objects.filter(endpoint=hostile, status=DeliveryStatus.PENDING).exists(),
        "the hostile deliveries' ending",
        webhooks,
    )
    wait_until_idle([webhooks])
    log = webhooks.log_path.read_text(errors="replace")
    assert f"http://127.0.0.1:{slow.port}/…" in log
    assert "SECRET" not in log
