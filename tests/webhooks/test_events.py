"""Which events a job's or a batch's life sends, in OpenAI's event shape; `job.progress` throttled."""

from __future__ import annotations

import time
from typing import Any

import pytest

from portal.jobs.models import Job, JobStatus
from portal.jobs.signals import job_ended
from portal.openai_api.models import Batch
from portal.openai_api.services.batches import batch_create, batch_finalize
from portal.openai_api.services.files import file_upload
from portal.tenancy.models import Tenant
from portal.webhooks.models import WebhookDelivery
from portal.webhooks.services.events import webhook_jobs_progress
from tests.factories import TenantFactory
from tests.webhooks.conftest import endpoint_for

pytestmark = pytest.mark.django_db

HOOK = "https://93.184.215.14/hook"  # a public address: registration needs no allow-list, nothing is sent here


def _job(tenant: Tenant, model: Any, status: str = JobStatus.RUNNING) -> Job:
    return Job.objects.create(tenant=tenant, model=model, input_uri="file:///x.jsonl", status=status, total_records=10)


def _events() -> list[tuple[str, dict[str, Any]]]:
    return [(d.event_type, d.payload["data"]) for d in WebhookDelivery.objects.order_by("pk")]


@pytest.mark.parametrize(
    ("status", "event_type"),
    [
        (JobStatus.SUCCEEDED, "job.completed"),
        (JobStatus.PARTIALLY_SUCCEEDED, "job.completed"),
        (JobStatus.FAILED, "job.failed"),
        (JobStatus.CANCELLED, "job.cancelled"),
        (JobStatus.EXPIRED, "job.expired"),
    ],
)
def test_a_native_job_that_ends_sends_its_ending(acme: Tenant, minilm: Any, status: str, event_type: str) -> None:
    endpoint_for(acme, HOOK)
    job = _job(acme, minilm, status)
    job_ended.send(sender=Job, job_id=str(job.pk), status=status)

    [delivery] = WebhookDelivery.objects.all()
    assert delivery.event_type == event_type and delivery.event_id.startswith("evt_")
    assert delivery.payload == {
        "id": delivery.event_id,
        "object": "event",
        "type": event_type,
        "created_at": delivery.payload["created_at"],
        "data": {"id": str(job.pk), "status": status},
    }
    assert abs(delivery.payload["created_at"] - time.time()) < 60


def test_only_subscribed_enabled_endpoints_of_the_jobs_own_tenant_get_the_event(acme: Tenant, minilm: Any) -> None:
    wanted = endpoint_for(acme, HOOK, "job.completed")
    endpoint_for(acme, HOOK, "job.failed")
    endpoint_for(TenantFactory(name="globex"), HOOK)
    job = _job(acme, minilm, JobStatus.SUCCEEDED)
    job_ended.send(sender=Job, job_id=str(job.pk), status=JobStatus.SUCCEEDED)
    assert list(WebhookDelivery.objects.values_list("endpoint", flat=True)) == [wanted.pk]


def test_a_batch_sends_batch_completed_in_openais_shape_once_its_files_are_written(acme: Tenant, minilm: Any) -> None:
    endpoint_for(acme, HOOK)
    job = _job(acme, minilm, JobStatus.SUCCEEDED)
    batch = Batch.objects.create(
        id="batch_0123456789abcdef01234567",
        tenant=acme,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id="file-x",
        job=job,
    )
    job_ended.send(sender=Job, job_id=str(job.pk), status=JobStatus.SUCCEEDED)
    assert _events() == [], "the batch is still finalizing: no job event, no batch event yet"

    assert batch_finalize(batch_id=batch.id)
    assert not batch_finalize(batch_id=batch.id)
    [delivery] = WebhookDelivery.objects.all()
    assert delivery.payload == {
        "id": delivery.event_id,
        "object": "event",
        "type": "batch.completed",
        "created_at": delivery.payload["created_at"],
        "data": {"id": batch.id},
    }


def test_a_batch_whose_file_fails_validation_sends_batch_failed(acme: Tenant, minilm: Any) -> None:
    endpoint_for(acme, HOOK, "batch.failed")
    upload = file_upload(tenant=acme, filename="bad.jsonl", purpose="batch", chunks=[b"not json\n"])
    batch = batch_create(
        tenant=acme, user=None, input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert _events() == [("batch.failed", {"id": batch.id})]


def test_job_progress_goes_out_at_most_once_a_period_per_job(acme: Tenant, minilm: Any, settings: Any) -> None:
    settings.BATCHERY_WEBHOOK_PROGRESS_EVERY_S = 0.5
    endpoint_for(acme, HOOK, "job.progress")
    job, other = _job(acme, minilm), _job(acme, minilm)

    for _ in range(3):
        webhook_jobs_progress(jobs=[job, other])
    assert sorted(data["id"] for _, data in _events()) == sorted([str(job.pk), str(other.pk)])
    time.sleep(0.6)
    webhook_jobs_progress(jobs=[job])
    events = _events()
    assert [data["id"] for _, data in events].count(str(job.pk)) == 2
    assert events[-1] == ("job.progress", {"id": str(job.pk), "status": "running", "total": 10, "done": 0, "failed": 0})


def test_job_progress_is_not_sent_for_batches_ended_jobs_or_tenants_not_listening(
    acme: Tenant, minilm: Any, settings: Any
) -> None:
    settings.BATCHERY_WEBHOOK_PROGRESS_EVERY_S = 0.001
    endpoint_for(acme, HOOK, "job.completed")
    quiet = _job(acme, minilm)
    globex = TenantFactory(name="globex")
    endpoint_for(globex, HOOK, "job.progress")
    ended = _job(globex, minilm, JobStatus.SUCCEEDED)
    batch_job = _job(globex, minilm)
    Batch.objects.create(
        id="batch_x",
        tenant=globex,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id="f",
        job=batch_job,
    )
    webhook_jobs_progress(jobs=[quiet, ended, batch_job])
    assert _events() == []
