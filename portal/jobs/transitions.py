"""Job status changes, each a conditional UPDATE: zero rows changed means someone got there first.

Callers name the edge they mean (`source` → `target`); an edge that `Job.TRANSITIONS` does not allow
is a programming error and raises. A job that ends gets its usage ledger line in the same
transaction, and `job_ended` is sent once that transaction commits.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from django.db import transaction
from django.utils import timezone

from portal.jobs.models import FINAL_STATUSES, Job, JobEvent, JobStatus
from portal.jobs.signals import job_ended, job_ending
from portal.jobs.usage import usage_record

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 20_000
ACTIVE_STATUSES = frozenset(JobStatus) - FINAL_STATUSES


def job_transition(*, job_id: str, source: str | Collection[str], target: str, **fields: Any) -> bool:
    """Move a job from `source` (one status or several) to `target`; True if this call moved it."""
    sources = {source} if isinstance(source, str) else set(source)
    refused = [status for status in sources if not Job.can_transition(status, target)]
    if refused:
        raise ValueError(f"a job may not go from {', '.join(sorted(refused))} to {target}")
    with transaction.atomic():
        moved = Job.objects.filter(pk=job_id, status__in=sources).update(
            status=target, updated_at=timezone.now(), **fields
        )
        if moved:
            JobEvent.objects.create(job_id=job_id, status=target)
            if target in FINAL_STATUSES:
                _job_ended(job_id, target)
    if not moved:
        current = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
        logger.info("job %s not moved to %s: it is %s", job_id, target, current or "gone")
    return bool(moved)


def _job_ended(job_id: str, status: str) -> None:
    job = Job.objects.select_related("model__gpu_class", "tenant").get(pk=job_id)
    job_ending.send(sender=Job, job=job, gpu_seconds_added=usage_record(job=job))
    transaction.on_commit(lambda: job_ended.send(sender=Job, job_id=job_id, status=status))


def job_fail(*, job_id: str, reason: str, source: str | Collection[str] | None = None) -> bool:
    """End a job as failed with a reason for people; a job already ended keeps its ending."""
    sources = source if source is not None else Job.sources_of(JobStatus.FAILED)
    sources = {sources} if isinstance(sources, str) else set(sources) & ACTIVE_STATUSES
    return job_transition(
        job_id=job_id,
        source=sources,
        target=JobStatus.FAILED,
        error=reason[:MAX_ERROR_CHARS],
        finished_at=timezone.now(),
    )
