"""When a batch's job ends, its OpenAI output files are written by a control task."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from portal.jobs.signals import job_ended


@receiver(job_ended)
def finalize_batch_of_job(sender: Any, job_id: str, status: str, **kwargs: Any) -> None:
    from portal.batches.models import Batch
    from tasks.control.finalize_batch import finalize_batch

    batch_id = Batch.objects.filter(job_id=job_id).values_list("id", flat=True).first()
    if batch_id is not None:
        finalize_batch.delay(batch_id)
