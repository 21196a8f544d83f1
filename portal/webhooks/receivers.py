"""When a native job ends, its tenant's endpoints hear of it (batches send their own event once finalized)."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from portal.jobs.signals import job_ended
from portal.webhooks.services.events import webhook_job_ended


@receiver(job_ended)
def send_job_ending(sender: Any, job_id: str, status: str, **kwargs: Any) -> None:
    webhook_job_ended(job_id=job_id, status=status)
