"""Pause and resume a running job: while paused no new shard of it starts; running shards finish.

The job's status in PostgreSQL is the truth: the scheduler sends shards of running jobs only.
Shards already waiting in the broker (the queue's window) would still start, so the job's pause
flag in Redis (`tasks.shared.stops`) and a marker in its storage make each return unrun on arrival, and
the scheduler puts it back to pending at no cost. The marker covers the moments after Redis was
lost, when a worker that reconnects gives back the shards it held and the reconciler has not yet
raised the flag again (it does on every sweep). A deadline keeps running while paused. Output is
the same as without the pause: shards run once each, whenever they run.
"""

from __future__ import annotations

import logging

from django.contrib.auth.models import User
from django.db import transaction

from portal.audit.services import audit_record
from portal.execution.endings import merge_when_settled
from portal.execution.scheduler import schedule_job
from portal.jobs.models import Job, JobStatus
from portal.jobs.storage_layout import job_root, pause_marker_uri
from portal.jobs.transitions import job_transition
from tasks.shared.stops import clear_pause, request_pause
from tasks.shared.storage import store_for

logger = logging.getLogger(__name__)


class CannotPause(Exception):
    """The job is not running (to pause) or not paused (to resume)."""


def _audit(job: Job, action: str, old: str, new: str, actor: User | None) -> None:
    audit_record(
        actor=actor,
        action=action,
        target=job,
        tenant=job.tenant,
        summary=f"job {job.id} {new} (was {old})",
        changes={"status": [old, new]},
    )


def job_pause(*, job: Job, actor: User | None = None) -> Job:
    """Pause a running job; `actor` is who asked, for the audit log."""
    job_id = str(job.id)
    marker = pause_marker_uri(job_root(job))
    # The flag and the marker go up first: a shard arriving between the commit and them would start.
    request_pause([job_id])
    store_for(marker).put_if_absent(marker, b"paused")
    with transaction.atomic():
        if not job_transition(job_id=job_id, source=JobStatus.RUNNING, target=JobStatus.PAUSED):
            clear_pause(job_id)
            store_for(marker).delete_prefix(marker)
            job.refresh_from_db()
            raise CannotPause(f"job {job_id} is {job.status}; only a running job can be paused")
        _audit(job, "job.paused", JobStatus.RUNNING, JobStatus.PAUSED, actor)
    logger.info("job %s paused", job_id)
    return Job.objects.get(pk=job_id)


def job_resume(*, job: Job, actor: User | None = None) -> Job:
    """Resume a paused job: its waiting shards are scheduled again, and it merges if none is left."""

    job_id = str(job.id)
    with transaction.atomic():
        if not job_transition(job_id=job_id, source=JobStatus.PAUSED, target=JobStatus.RUNNING):
            job.refresh_from_db()
            raise CannotPause(f"job {job_id} is {job.status}; only a paused job can be resumed")
        _audit(job, "job.resumed", JobStatus.PAUSED, JobStatus.RUNNING, actor)
    clear_pause(job_id)
    marker = pause_marker_uri(job_root(job))
    store_for(marker).delete_prefix(marker)
    schedule_job(job_id=job_id)
    merge_when_settled(Job.objects.get(pk=job_id))
    logger.info("job %s resumed", job_id)
    return Job.objects.get(pk=job_id)
