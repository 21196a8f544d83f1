"""Job status changes, each a conditional UPDATE: zero rows changed means someone got there first."""

from __future__ import annotations

import logging
from typing import Any

from django.utils import timezone

from portal.jobs.models import Job, JobStatus

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 20_000


def job_transition(*, job_id: str, target: str, **fields: Any) -> bool:
    """Move a job to `target` from any status allowed to precede it; True if this call moved it."""
    sources = Job.sources_of(target)
    moved = Job.objects.filter(pk=job_id, status__in=sources).update(status=target, updated_at=timezone.now(), **fields)
    if not moved:
        current = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
        logger.info("job %s not moved to %s: it is %s", job_id, target, current or "gone")
    return bool(moved)


def job_fail(*, job_id: str, reason: str) -> bool:
    """End a job as failed with a reason for people; a job already ended keeps its ending."""
    return job_transition(
        job_id=job_id, target=JobStatus.FAILED, error=reason[:MAX_ERROR_CHARS], finished_at=timezone.now()
    )
