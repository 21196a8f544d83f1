"""Reads of jobs that pages, the API and the CLI share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, QuerySet, Sum

from portal.jobs.models import Job, JobUsage
from portal.jobs.services.storage_layout import job_root, parquet_output_uri
from tasks.progress import read_job_progress


@dataclass(frozen=True)
class JobProgress:
    status: str
    total: int | None
    """Records in the job, once known."""
    done: int
    """Records finished, succeeded or failed."""
    failed: int

    @property
    def fraction(self) -> float:
        if not self.total:
            return 0.0
        return min(1.0, self.done / self.total)


def job_progress(job: Job) -> JobProgress:
    """Live figures from Redis while the job runs; the database's once it has ended."""
    if job.is_finished:
        done = job.succeeded_records + job.failed_records
        return JobProgress(status=job.status, total=job.total_records, done=done, failed=job.failed_records)
    live = read_job_progress(str(job.id))
    return JobProgress(status=job.status, total=job.total_records, done=live.done, failed=live.failed)


def job_output_file(job: Job) -> tuple[str, str]:
    """The output a job asked for, as (URI, file name): its Parquet copy, or the JSONL."""
    if job.output_format == "parquet":
        return parquet_output_uri(job_root(job)), "output.parquet"
    return job.output_uri, "output.jsonl"


def usage_per_month(usage: QuerySet[JobUsage]) -> QuerySet[Any, Any]:
    """Ledger lines summed per month, newest first: jobs, records, tokens in and out, GPU-seconds."""
    return (
        usage.order_by()
        .values("period")
        .annotate(
            jobs=Count("job"),
            records_succeeded=Sum("records_succeeded"),
            records_failed=Sum("records_failed"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            gpu_seconds=Sum("gpu_seconds"),
        )
        .order_by("-period")
    )
