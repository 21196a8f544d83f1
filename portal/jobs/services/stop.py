"""Stopping a job before it ends: cancel (a person asks) and expire (its deadline passed).

Both raise the job's stop flag, so queued shards are skipped on arrival and running ones stop at
their next micro-batch, then finalize at once: committed shards are kept, every other record gets
an error line coded `cancelled` or `expired`.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from portal.audit.services import audit_record
from portal.execution.dispatch import shards_revoke
from portal.jobs.models import FINAL_STATUSES, Job, JobStatus
from portal.jobs.transitions import job_transition
from tasks import send
from tasks.shared.stops import request_stop

logger = logging.getLogger(__name__)


STOPPABLE = (JobStatus.RUNNING, JobStatus.PAUSED)
"""Statuses from which a started job is stopped by finalizing it (the others end at once)."""


class CannotStop(Exception):
    """The job has already ended, or is ending."""


def _finalize(job_id: str, stop: str) -> None:
    transaction.on_commit(lambda: send.send_merge(job_id, stop=stop))


def _end_before_running(job_id: str, ending: str) -> bool:
    """A job that has not started running ends at once: nothing ran, nothing to finalize."""
    return job_transition(
        job_id=job_id,
        source=(JobStatus.QUEUED, JobStatus.PLANNING),
        target=ending,
        finished_at=timezone.now(),
        error=f"{ending} before it ran",
    )


def _audit_cancel(job: Job, old_status: str, new_status: str, actor: User | None) -> None:
    audit_record(
        actor=actor,
        action="job.cancelled",
        target=job,
        tenant=job.tenant,
        summary=f"job {job.id} {new_status} (was {old_status})",
        changes={"status": [old_status, new_status]},
    )


def job_cancel(*, job: Job, actor: User | None = None) -> Job:
    """Cancel a job: at once if it has not started running, else within a micro-batch. `actor` is who
    asked, for the audit log."""
    job_id = str(job.id)
    request_stop(job_id, "cancelled")
    if _end_before_running(job_id, JobStatus.CANCELLED):
        _audit_cancel(job, job.status, JobStatus.CANCELLED, actor)
        return Job.objects.get(pk=job_id)
    with transaction.atomic():
        if not job_transition(job_id=job_id, source=STOPPABLE, target=JobStatus.CANCELLING):
            job.refresh_from_db()
            raise CannotStop(
                f"job {job_id} is {job.status}; only a queued, planning, running or paused job can be cancelled"
            )
        shards_revoke(job)
        _finalize(job_id, "cancelled")
        _audit_cancel(job, job.status, JobStatus.CANCELLING, actor)
    logger.info("job %s cancelling", job_id)
    return Job.objects.get(pk=job_id)


def job_expire(*, job: Job) -> bool:
    """End a job past its deadline: `expired`, with what finished kept. True if this call did it."""
    job_id = str(job.id)
    request_stop(job_id, "expired")
    if _end_before_running(job_id, JobStatus.EXPIRED):
        return True
    if job.status not in STOPPABLE:
        return False
    shards_revoke(job)
    with transaction.atomic():
        _finalize(job_id, "expired")
    return True


def jobs_expire_overdue(*, now: dt.datetime) -> int:
    """The lifecycle's part of the periodic sweep: end every job past its deadline (`job_expire`), each
    on its own; how many this sweep ended. A job already merging or cancelling ends as it is."""
    expired = 0
    overdue = Job.objects.exclude(status__in=FINAL_STATUSES).filter(deadline_at__lte=now)
    for job in overdue.exclude(status__in=[JobStatus.CANCELLING, JobStatus.MERGING]):
        try:
            expired += job_expire(job=job)
        except Exception:
            logger.exception("sweep: expiring job %s failed; the next sweep tries again", job.id)
    return expired
