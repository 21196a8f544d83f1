"""The platform's metrics count what jobs and shards do, as the apps that do it tell (signals)."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from portal.execution.signals import shards_redispatched
from portal.jobs.models import Job
from portal.jobs.signals import job_ending
from portal.ops.metrics.jobs import job_ending_record, shards_redispatched_record


@receiver(job_ending)
def count_job_ending(sender: Any, job: Job, gpu_seconds_added: float, **kwargs: Any) -> None:
    job_ending_record(job=job, gpu_seconds_added=gpu_seconds_added)


@receiver(shards_redispatched)
def count_shards_redispatched(sender: Any, job: Job, count: int, **kwargs: Any) -> None:
    shards_redispatched_record(job=job, count=count)
