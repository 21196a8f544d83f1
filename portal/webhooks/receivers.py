"""When a native job ends or progresses, its tenant's endpoints hear of it (batches send their own event once
finalized)."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from portal.execution.signals import jobs_progressed
from portal.jobs.models import Job
from portal.jobs.signals import job_ended
from portal.webhooks.services.events import webhook_job_ended, webhook_jobs_progress


@receiver(job_ended)
def send_job_ending(sender: Any, job_id: str, status: str, **kwargs: Any) -> None:
    webhook_job_ended(job_id=job_id, status=status)


@receiver(jobs_progressed)
def send_jobs_progress(sender: Any, jobs: list[Job], **kwargs: Any) -> None:
    webhook_jobs_progress(jobs=jobs)
