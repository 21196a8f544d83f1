"""Events: what happened to a job or a batch, turned into one delivery per endpoint that wants it.

Batch events are sent once the batch's output files are written (`batch_finalize`), since only then
does the batch read `completed` with its `output_file_id`; native jobs' events when the job ends
(`job_ended`), and `job.progress` from the scheduler's settling of shards, at most every
`BATCHERY_WEBHOOK_PROGRESS_EVERY_S` per job.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.jobs.models import Job, JobStatus
from portal.jobs.selectors import job_progress, jobs_live_progress
from portal.openai_api.models import Batch
from portal.openai_api.selectors import batch_status
from portal.webhooks.models import WebhookDelivery, WebhookEndpoint
from tasks import send
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

# Job endings by the event they send; a partial success is a completion, as OpenAI's batches have it.
JOB_EVENTS: dict[str, str] = {
    JobStatus.SUCCEEDED: "job.completed",
    JobStatus.PARTIALLY_SUCCEEDED: "job.completed",
    JobStatus.FAILED: "job.failed",
    JobStatus.CANCELLED: "job.cancelled",
    JobStatus.EXPIRED: "job.expired",
}
BATCH_ENDINGS = frozenset({"completed", "failed", "cancelled", "expired"})
PROGRESS = "job.progress"


def _progress_key(job_id: str) -> str:
    return f"batchery:webhook-progress:{job_id}"


def webhook_event_emit(*, tenant_id: int, event_type: str, data: dict[str, Any]) -> list[WebhookDelivery]:
    """Record the event for each of the tenant's endpoints that want it and send it after commit."""
    # Event types are matched here rather than in SQL: JSON containment is PostgreSQL's alone.
    enabled = WebhookEndpoint.objects.filter(tenant_id=tenant_id, enabled=True)
    endpoints = [endpoint for endpoint in enabled if endpoint.wants(event_type)]
    if not endpoints:
        return []
    # OpenAI's webhook event shape: {"id": "evt_…", "object": "event", "type", "created_at", "data"}.
    event_id = f"evt_{secrets.token_hex(12)}"
    payload = {"id": event_id, "object": "event", "type": event_type, "created_at": int(time.time()), "data": data}
    now = timezone.now()
    deliveries = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(
            endpoint=endpoint, event_id=event_id, event_type=event_type, payload=payload, next_attempt_at=now
        )
        for endpoint in endpoints
    )
    ids = [delivery.pk for delivery in deliveries]
    # Inside the caller's transaction (a batch's finalize), the messages wait for its commit.
    transaction.on_commit(lambda: _send(ids))
    return deliveries


def _send(delivery_ids: list[int]) -> None:
    try:
        for delivery_id in delivery_ids:
            send.send_webhook_delivery(delivery_id)
    except Exception:
        # The rows are committed: the sweep (`webhooks_sweep`) sends what no message carried.
        logger.warning("webhook deliveries %s not enqueued; the sweep sends them", delivery_ids, exc_info=True)


def webhook_job_ended(*, job_id: str, status: str) -> list[WebhookDelivery]:
    """A native job ended: `job.<ending>`. A batch's job sends nothing here: its batch sends its own
    event once finalized (`webhook_batch_ended`)."""
    event_type = JOB_EVENTS.get(status)
    if event_type is None or Batch.objects.filter(job_id=job_id).exists():
        return []
    tenant_id = Job.objects.filter(pk=job_id).values_list("tenant_id", flat=True).first()
    if tenant_id is None:
        return []
    return webhook_event_emit(tenant_id=tenant_id, event_type=event_type, data={"id": str(job_id), "status": status})


def webhook_batch_ended(*, batch: Batch) -> list[WebhookDelivery]:
    """`batch.<status>` for a batch that has reached its final status, with OpenAI's `data: {"id"}`."""
    status = batch_status(batch)
    if status not in BATCH_ENDINGS:
        return []
    return webhook_event_emit(tenant_id=batch.tenant_id, event_type=f"batch.{status}", data={"id": batch.id})


def webhook_jobs_progress(*, jobs: Sequence[Job]) -> None:
    """`job.progress` for native jobs still running whose tenant listens, at most once a period per job.

    Called where shards settle; a progress event is a courtesy, so nothing here may fail the settling."""
    try:
        _jobs_progress(jobs)
    except Exception:
        logger.exception("job.progress webhooks for %d jobs not sent", len(jobs))


def _jobs_progress(jobs: Sequence[Job]) -> None:
    running = [job for job in jobs if not job.is_finished]
    if not running:
        return
    endpoints = WebhookEndpoint.objects.filter(tenant_id__in={job.tenant_id for job in running}, enabled=True)
    listening = {endpoint.tenant_id for endpoint in endpoints if endpoint.wants(PROGRESS)}
    candidates = [job for job in running if job.tenant_id in listening]
    if not candidates:
        return
    batch_jobs = set(Batch.objects.filter(job__in=candidates).values_list("job_id", flat=True))
    period_ms = max(1, round(settings.BATCHERY_WEBHOOK_PROGRESS_EVERY_S * 1000))
    # SET NX with an expiry: the first settle of a period wins it; the others in that period send nothing.
    due = [
        job
        for job in candidates
        if job.pk not in batch_jobs and redis_client().set(_progress_key(str(job.pk)), 1, nx=True, px=period_ms)
    ]
    live = jobs_live_progress(due)
    for job in due:
        progress = job_progress(job, live.get(str(job.pk)))
        data = {
            "id": str(job.pk),
            "status": job.status,
            "total": progress.total,
            "done": progress.done,
            "failed": progress.failed,
        }
        webhook_event_emit(tenant_id=job.tenant_id, event_type=PROGRESS, data=data)
