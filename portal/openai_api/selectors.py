"""Batches and files as OpenAI's API shows them: statuses, counts and timestamps read off the job."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db.models import Count, Sum
from django.db.models.functions import Coalesce
from django.urls import reverse
from rest_framework.request import Request

from portal.jobs.input_display import tenant_job_error
from portal.jobs.models import Job, JobStatus, JobUsage
from portal.jobs.selectors import job_progress, job_steps
from portal.jobs.services.partial import OFFERED_STATUSES
from portal.openai_api.models import Batch, File

# Job statuses while a batch runs, as OpenAI names them.
RUNNING_STATUSES: dict[str, str] = {
    JobStatus.QUEUED: "validating",
    JobStatus.PLANNING: "validating",
    JobStatus.RUNNING: "in_progress",
    JobStatus.PAUSED: "in_progress",
    JobStatus.MERGING: "finalizing",
    JobStatus.CANCELLING: "cancelling",
}
# Job endings once the output files are written; until then the batch is still finalizing (or cancelling).
ENDED_STATUSES: dict[str, str] = {
    JobStatus.SUCCEEDED: "completed",
    JobStatus.PARTIALLY_SUCCEEDED: "completed",
    JobStatus.EXPIRED: "expired",
    JobStatus.CANCELLED: "cancelled",
}


def _seconds(moment: dt.datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def batch_status(batch: Batch) -> str:
    job = batch.job
    if batch.validation_errors is not None:
        return "failed"
    if job is None:
        # No job yet: its input file is being validated (`batchery.validate_batch`), or it was cancelled
        # meanwhile. One that ended otherwise without a job (its job deleted by an operator) failed.
        if batch.cancelled_at is not None:
            return "cancelled"
        return "validating" if batch.finalized_at is None else "failed"
    if job.status in RUNNING_STATUSES:
        return RUNNING_STATUSES[job.status]
    if batch.finalized_at is None:
        return "cancelling" if job.status == JobStatus.CANCELLED else "finalizing"
    if job.status == JobStatus.FAILED:
        # Requests that ran and all failed make a completed batch with an error file, as at OpenAI;
        # a job that failed before running any (its input refused by the planner) fails the batch.
        return "completed" if job.shard_count else "failed"
    return ENDED_STATUSES[job.status]


def _request_counts(job: Job | None) -> dict[str, int]:
    if job is None:
        return {"total": 0, "completed": 0, "failed": 0}
    if job.is_finished:
        return {
            "total": job.total_records or 0,
            "completed": job.succeeded_records,
            "failed": job.failed_records,
        }
    progress = job_progress(job)
    return {"total": progress.total or 0, "completed": progress.done - progress.failed, "failed": progress.failed}


def _usage(job: Job | None) -> dict[str, Any] | None:
    """OpenAI's token totals of the batch: the ledger's once the job has ended, its committed shards' before."""
    if job is None:
        return None
    if job.is_finished:
        # The sum of its lines: one per ending, its first and each retry round's.
        ledger = JobUsage.objects.filter(job=job).aggregate(
            lines=Count("pk"),
            prompt_tokens=Coalesce(Sum("prompt_tokens"), 0),
            completion_tokens=Coalesce(Sum("completion_tokens"), 0),
            cached_prompt_tokens=Coalesce(Sum("cached_prompt_tokens"), 0),
        )
        if not ledger["lines"]:
            return None
        input_tokens, output_tokens = int(ledger["prompt_tokens"]), int(ledger["completion_tokens"])
        cached_tokens = int(ledger["cached_prompt_tokens"])
    else:
        totals = job.shards.aggregate(
            prompt_tokens=Coalesce(Sum("prompt_tokens"), 0),
            completion_tokens=Coalesce(Sum("completion_tokens"), 0),
            cached_prompt_tokens=Coalesce(Sum("cached_prompt_tokens"), 0),
        )
        input_tokens, output_tokens = int(totals["prompt_tokens"]), int(totals["completion_tokens"])
        cached_tokens = int(totals["cached_prompt_tokens"])
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _errors(batch: Batch, status: str) -> dict[str, Any] | None:
    if batch.validation_errors is not None:
        return dict(batch.validation_errors)
    if status == "failed" and batch.job is not None:
        return {
            "object": "list",
            "data": [{"code": "invalid_input", "message": tenant_job_error(batch.job), "param": None, "line": None}],
        }
    return None


def _partial_output_url(job: Job | None, request: Request | None) -> str | None:
    """The partial download of the batch's job while it runs (Batchery's output lines, not OpenAI's):
    absolute where the request tells the host, else the path."""
    if job is None or job.status not in OFFERED_STATUSES:
        return None
    path = reverse("api:job-output", kwargs={"pk": job.pk}) + "?partial=true"
    return request.build_absolute_uri(path) if request is not None else path


def batch_object(batch: Batch, *, request: Request | None = None) -> dict[str, Any]:
    """The batch as OpenAI's `Batch` object, with one field of Batchery's own, `partial_output_url`
    (OpenAI's clients keep fields they do not know)."""
    status = batch_status(batch)
    job = batch.job
    reached = dict(job_steps(job)) if job is not None else {}
    ended_at = batch.finalized_at if status in ("completed", "failed", "expired", "cancelled") else None
    window_hours = int(batch.completion_window.rstrip("h"))
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": job.model.name if job is not None else None,
        "errors": _errors(batch, status),
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _seconds(batch.created_at),
        "in_progress_at": _seconds(reached.get(JobStatus.RUNNING)),
        "expires_at": _seconds(batch.created_at + dt.timedelta(hours=window_hours)),
        "finalizing_at": _seconds(reached.get(JobStatus.MERGING)),
        "completed_at": _seconds(ended_at) if status == "completed" else None,
        "failed_at": _seconds(ended_at or batch.created_at) if status == "failed" else None,
        "expired_at": _seconds(ended_at) if status == "expired" else None,
        "cancelling_at": _seconds(
            reached.get(JobStatus.CANCELLING) or reached.get(JobStatus.CANCELLED) or batch.cancelled_at
        ),
        "cancelled_at": _seconds(ended_at) if status == "cancelled" else None,
        "request_counts": _request_counts(job),
        "usage": _usage(job),
        "metadata": batch.metadata,
        "partial_output_url": _partial_output_url(job, request),
    }


def file_object(file: File) -> dict[str, Any]:
    """The file as OpenAI's `FileObject`."""
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _seconds(file.created_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "expires_at": _seconds(file.expires_at),
        "status_details": None,
    }
