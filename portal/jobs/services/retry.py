"""Retry failed only: re-run the records of a finished job that ended as errors, as a new round.

The request only records the retry: the tenant's quota and monthly budget are held for the round as for a
submission (the same `quota_reserve` and `budget_reserve`, with the quota row locked), the job is set
`planning` with its next round number, and the planning task cuts the round on the planning lane
(`portal.execution.retry_round`), streaming the error file and the last round's shard inputs side by side.
The merge of that round puts each new line in place of the error line it replaces, in the same output file.
"""

from __future__ import annotations

import datetime as dt
import logging
from decimal import Decimal

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from portal.audit.services import audit_record
from portal.catalog.money import ZERO
from portal.jobs.billing import job_cost
from portal.jobs.budget import budget_reserve
from portal.jobs.models import RETRYABLE_STATUSES, Job, JobStatus
from portal.jobs.quota import quota_reserve
from portal.jobs.services.retention import shards_kept
from portal.jobs.transitions import job_transition
from portal.tenancy.models import BudgetHold
from tasks import send

logger = logging.getLogger(__name__)


class CannotRetry(Exception):
    """The job is not in an ending that has failed records to run again."""


def job_retryable(job: Job, *, now: dt.datetime) -> bool:
    """Whether `job_retry` may run the job again: it ended with failed records, and within the retention
    (`shards_kept`), since the retry reads the last round's shard inputs from the shard rows."""
    return _retry_refusal(job, now=now) is None


def _retry_refusal(job: Job, *, now: dt.datetime) -> str | None:
    """Why `job_retry` cannot run the job again; None where it can (the one rule `job_retryable` reads too)."""
    if job.status not in RETRYABLE_STATUSES or not job.shard_count:
        return f"job {job.id} is {job.status}; only a partially succeeded, failed or expired job retries"
    if not shards_kept(job, now=now):
        return (
            f"job {job.id} ended more than {settings.BATCHERY_SHARD_RETENTION_DAYS} days ago and its shard rows are "
            "removed (BATCHERY_SHARD_RETENTION_DAYS): it can be re-run, no longer retried"
        )
    if not job.failed_records:
        return f"job {job.id} has no failed records"
    return None


def retry_hold(job: Job) -> Decimal:
    """What a retry round of the job's failed records holds against the budget: their share of the larger of
    what the job has cost per record so far and what its submission held per record."""
    done = job.succeeded_records + job.failed_records
    if not done:
        return ZERO
    held = BudgetHold.objects.filter(job_id=job.pk).values_list("amount", flat=True).first() or ZERO
    per_record = max(job_cost(job) / done, held / (job.total_records or done))
    return per_record * job.failed_records


def job_retry(*, job: Job, actor: User | None = None) -> Job:
    """Run the failed records of an ended job again; `actor` is who asked, for the audit log.

    Raises `CannotRetry` for a job with nothing to retry, and `QuotaExceeded` where the tenant's quota or
    monthly budget refuses the round, as it would refuse a submission."""
    refusal = _retry_refusal(job, now=timezone.now())
    if refusal is not None:
        raise CannotRetry(refusal)
    job_id = str(job.id)
    round_ = job.retry_round + 1
    hold = retry_hold(job)
    with transaction.atomic():
        # While the round runs the job counts as not ended again, with its records: held as a submission is.
        quota = quota_reserve(job.tenant, input_bytes=0, records=job.total_records)
        budget_reserve(quota, job_id=job_id, hold=hold)
        moved = job_transition(
            job_id=job_id, source=job.status, target=JobStatus.PLANNING, retry_round=round_, error="", finished_at=None
        )
        if not moved:
            raise CannotRetry(f"job {job_id} changed while being retried")
        transaction.on_commit(lambda: send.send_plan(job_id, task_id=f"plan-{job_id}"))
        audit_record(
            actor=actor,
            action="job.retried",
            target=job,
            tenant=job.tenant,
            summary=f"job {job_id}: {job.failed_records} failed records run again (round {round_})",
            changes={"status": [job.status, JobStatus.PLANNING], "retry_round": [job.retry_round, round_]},
        )
    logger.info("job %s: retry round %d of %d failed records sent to planning", job_id, round_, job.failed_records)
    return Job.objects.get(pk=job_id)
