"""Stopping a running job at its tenant's monthly budget, as its shards settle.

The budget is held at submission against a forecast (`portal.jobs.budget`); what a job really costs is
known shard by shard. Each settling looks at the running jobs of tenants with a budget: one whose spend
reaches it (`budget_reached`) is stopped as a deadline stops a job (no new shard starts, running ones stop
at their next micro-batch, queued ones are revoked), and merged with what finished kept
(`merge.BUDGET_STOP`: partially succeeded, or failed where nothing succeeded, the reason in its error).
"""

from __future__ import annotations

import logging

from django.db import transaction

from portal.execution.dispatch import shards_revoke
from portal.execution.merge import BUDGET_STOP
from portal.jobs.budget import budget_reached
from portal.jobs.models import Job, JobStatus
from portal.tenancy.models import Quota
from tasks import send
from tasks.shared.stops import request_stop

logger = logging.getLogger(__name__)


def jobs_within_budget(jobs: list[Job]) -> list[Job]:
    """Stop the running jobs among `jobs` whose tenant's budget is reached; return the others. One query
    where no tenant of theirs has a budget."""
    tenants = {job.tenant_id for job in jobs}
    budgeted = set(
        Quota.objects.filter(tenant_id__in=tenants, monthly_budget__isnull=False).values_list("tenant_id", flat=True)
    )
    going = []
    for job in jobs:
        reason = budget_reached(job) if job.tenant_id in budgeted and job.status == JobStatus.RUNNING else None
        if reason is None:
            going.append(job)
        else:
            budget_stop(job, reason=reason)
    return going


def budget_stop(job: Job, *, reason: str) -> None:
    """Stop a running job at its tenant's budget and merge what it finished (see the module)."""
    job_id = str(job.id)
    # The flag first: a shard that arrives from now on does not start.
    request_stop(job_id, BUDGET_STOP)
    shards_revoke(job)
    logger.warning("job %s stopped at its tenant's budget: %s", job_id, reason)
    transaction.on_commit(lambda: send.send_merge(job_id, stop=BUDGET_STOP))
