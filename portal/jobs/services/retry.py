"""Retry failed only: re-run the records of a finished job that ended as errors, as a new round.

The failed ids are read from the job's error file, their records picked out of the last round's
shard inputs (in input order), cut into new shards of the next round and dispatched. The merge of
that round puts each new line in place of the error line it replaces, in the same output file.
"""

from __future__ import annotations

import datetime as dt
import logging

import orjson
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from portal.audit.services import audit_record
from portal.execution.scheduler import schedule_job
from portal.execution.shard_cut import ShardCut
from portal.execution.shard_writer import ShardWriter
from portal.jobs.models import RETRYABLE_STATUSES, Job, JobStatus, Shard
from portal.jobs.services.retention import shards_kept
from portal.jobs.storage_layout import job_root
from portal.jobs.transitions import job_transition
from tasks.shared.formats.records import Record, input_field_for
from tasks.shared.stops import clear_stop
from tasks.shared.storage import store_for

logger = logging.getLogger(__name__)


class CannotRetry(Exception):
    """The job is not in an ending that has failed records to run again."""


def _failed_ids(job: Job) -> set[str]:
    with store_for(job.errors_uri).open_read(job.errors_uri) as errors:
        return {orjson.loads(line)["custom_id"] for line in errors}


def job_retryable(job: Job, *, now: dt.datetime) -> bool:
    """Whether `job_retry` may run the job again: it ended with failed records, and within the retention
    (`shards_kept`), since the retry reads the last round's shard inputs from the shard rows."""
    ended_with_errors = job.status in RETRYABLE_STATUSES and job.shard_count > 0 and job.failed_records > 0
    return ended_with_errors and shards_kept(job, now=now)


def job_retry(*, job: Job, actor: User | None = None) -> Job:
    """Run the failed records of an ended job again; `actor` is who asked, for the audit log."""
    if job.status not in RETRYABLE_STATUSES or not job.shard_count:
        raise CannotRetry(f"job {job.id} is {job.status}; only a partially succeeded, failed or expired job retries")
    if not shards_kept(job, now=timezone.now()):
        raise CannotRetry(
            f"job {job.id} ended more than {settings.BATCHERY_SHARD_RETENTION_DAYS} days ago and its shard rows are "
            "removed (BATCHERY_SHARD_RETENTION_DAYS): it can be re-run, no longer retried"
        )
    failed = _failed_ids(job)
    if not failed:
        raise CannotRetry(f"job {job.id} has no failed records")
    job_id = str(job.id)
    round_ = job.retry_round + 1
    root = job_root(job)
    writer = ShardWriter(
        root,
        ShardCut.for_job(job),
        input_field=input_field_for(job.model.task),
        first_index=(job.shards.aggregate(last=Max("index"))["last"] or 0) + 1,
    )
    try:
        for shard in job.shards.filter(round=job.retry_round).order_by("index"):
            with store_for(shard.input_uri).open_read(shard.input_uri) as source:
                for raw in source:
                    data = orjson.loads(raw)
                    if data["custom_id"] in failed:
                        writer.add(Record(line=0, custom_id=data["custom_id"], data=data))
    except BaseException:
        writer.abort()
        raise
    planned = writer.close()
    clear_stop(job_id)
    with transaction.atomic():
        moved = job_transition(
            job_id=job_id, source=job.status, target=JobStatus.RUNNING, retry_round=round_, error="", finished_at=None
        )
        if not moved:
            raise CannotRetry(f"job {job_id} changed while being retried")
        Shard.objects.bulk_create(shard.row(job_id=job_id, root=root, round_=round_) for shard in planned)

        transaction.on_commit(lambda: schedule_job(job_id=job_id))
        audit_record(
            actor=actor,
            action="job.retried",
            target=job,
            tenant=job.tenant,
            summary=f"job {job_id}: {len(failed)} failed records run again (round {round_})",
            changes={"status": [job.status, JobStatus.RUNNING], "retry_round": [job.retry_round, round_]},
        )
    logger.info("job %s: retrying %d failed records in %d shards (round %d)", job_id, len(failed), len(planned), round_)
    return Job.objects.get(pk=job_id)
