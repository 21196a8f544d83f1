"""Retention: a job that ended longer ago than `BATCHERY_SHARD_RETENTION_DAYS` loses its shard rows and
its status events, so that the two tables that grow with the work done stay the size of the last weeks'.

Kept for good: the job row, with the counts every page and API read (records, shards, tokens through its
ledger lines `JobUsage`, which are never removed), and its events compacted into `Job.timeline`; the files
in storage, which have lifetimes of their own. Gone: the shard grid and the throughput chart of its page,
and `retry`, which re-reads the last round's shard inputs: a job can be retried for as long as it keeps
its rows (`shards_kept`), the retention.

The sweep (`jobs_prune`, a beat task of the control queue every `RETENTION_SWEEP_INTERVAL_S`) takes
the due jobs oldest first, a few hundred at a time, through the partial index on unpruned endings;
deletes their shard rows in statements of at most `ROWS_PER_DELETE` rows, each its own short
transaction, so that no lock is held for long and the WAL comes in small pieces; then, in one short
transaction for the lot, writes each job's timeline, deletes its events and its budget hold, and sets
`pruned_at`. Rows go
before the mark: a sweep stopped halfway (its time budget, a crash) leaves jobs unmarked, which the next
sweep takes again, and deleting what is already gone costs nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet, Subquery

from portal.jobs.models import FINAL_STATUSES, Job, JobEvent, Shard
from portal.tenancy.models import BudgetHold

logger = logging.getLogger(__name__)

ROWS_PER_DELETE = 5_000
"""Shard rows one DELETE removes at most: tens of milliseconds of row locks and WAL a statement."""
JOBS_PER_PASS = 200
"""Jobs a pass takes: their timelines are written in one UPDATE, their events go in one DELETE."""
SWEEP_BUDGET_S = 60.0
"""Seconds one sweep deletes for at most; a backlog (the first sweep after an upgrade) takes several."""
PRUNE_GRACE = dt.timedelta(hours=1)
"""Past the retention, a job keeps its rows this much longer: a retry that started in the last moments of
its window reads its shard inputs before the sweep may take them."""


@dataclass
class PruneReport:
    jobs: int = 0
    shards: int = 0
    events: int = 0
    holds: int = 0
    """Budget holds (`BudgetHold`), which stop counting once their job ends."""
    deletes: int = 0
    """DELETE statements on the shard table."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def retention() -> dt.timedelta | None:
    """How long an ended job keeps its rows; None: forever."""
    days = settings.BATCHERY_SHARD_RETENTION_DAYS
    return dt.timedelta(days=days) if days else None


def shards_kept(job: Job, *, now: dt.datetime) -> bool:
    """Whether the job still has its shard rows and may count on them until it is retried: not pruned,
    and (ended) within the retention."""
    if job.pruned_at is not None:
        return False
    kept_for = retention()
    return kept_for is None or job.finished_at is None or job.finished_at > now - kept_for


def jobs_due(*, now: dt.datetime) -> QuerySet[Job]:
    """The jobs whose rows the sweep removes, oldest ending first (the partial index's order)."""
    kept_for = retention()
    if kept_for is None:
        return Job.objects.none()
    return Job.objects.filter(
        pruned_at__isnull=True, finished_at__lt=now - kept_for - PRUNE_GRACE, status__in=FINAL_STATUSES
    ).order_by("finished_at")


def _delete_shards(job_ids: list[str], *, rows: int, deadline: float, report: PruneReport) -> bool:
    """Delete the jobs' shard rows, at most `rows` a statement; False if the time ran out first."""
    while time.monotonic() < deadline:
        # One statement: DELETE ... WHERE id IN (SELECT id ... WHERE job_id IN (...) LIMIT rows), read
        # through the (job, index) index; Shard has no signal receivers and nothing refers to it.
        batch = Shard.objects.filter(job_id__in=job_ids).order_by().values("pk")[:rows]
        deleted, _ = Shard.objects.filter(pk__in=Subquery(batch)).delete()
        report.deletes += 1
        report.shards += deleted
        if deleted < rows:
            return True
    return False


def _compact_events(job_ids: list[str], *, now: dt.datetime, report: PruneReport) -> None:
    """Write each job's events into its timeline, delete them, and mark the jobs pruned."""
    with transaction.atomic():
        steps: dict[str, list[list[str]]] = defaultdict(list)
        for job_id, status, at in (
            JobEvent.objects.filter(job_id__in=job_ids).order_by("at", "pk").values_list("job_id", "status", "at")
        ):
            steps[str(job_id)].append([status, at.isoformat()])
        jobs = list(Job.objects.filter(pk__in=job_ids, pruned_at__isnull=True).only("pk"))
        for job in jobs:
            job.pruned_at = now
            job.timeline = steps.get(str(job.pk), [])
        Job.objects.bulk_update(jobs, ["pruned_at", "timeline"])
        report.events += JobEvent.objects.filter(job_id__in=job_ids).delete()[0]
        report.holds += BudgetHold.objects.filter(job_id__in=job_ids).delete()[0]
        report.jobs += len(jobs)


def jobs_prune(
    *,
    now: dt.datetime,
    rows_per_delete: int = ROWS_PER_DELETE,
    jobs_per_pass: int = JOBS_PER_PASS,
    budget_s: float = SWEEP_BUDGET_S,
) -> PruneReport:
    """Remove the shard rows and events of the jobs that ended longer ago than the retention, for at
    most `budget_s` seconds; what is left, the next sweep removes."""
    report = PruneReport()
    started = time.monotonic()
    deadline = started + budget_s
    while time.monotonic() < deadline:
        job_ids = [str(pk) for pk in jobs_due(now=now).values_list("pk", flat=True)[:jobs_per_pass]]
        if not job_ids or not _delete_shards(job_ids, rows=rows_per_delete, deadline=deadline, report=report):
            break
        _compact_events(job_ids, now=now, report=report)
    report.seconds = time.monotonic() - started
    if report.jobs or report.shards:
        logger.info("retention: %s", report)
    return report
