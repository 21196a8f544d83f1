"""When a batch's job ends, its OpenAI output files are written by a control task."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from portal.jobs.signals import job_ended
from portal.openai_api.models import Batch
from tasks import send


@receiver(job_ended)
def finalize_batch_of_job(sender: Any, job_id: str, status: str, **kwargs: Any) -> None:
    batch_id = Batch.objects.filter(job_id=job_id).values_list("id", flat=True).first()
    if batch_id is not None:
        send.send_batch_finalize(batch_id)
