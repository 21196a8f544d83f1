"""Re-run: submit a job again as a new job, with the same input and settings (unlike `retry`, which
runs only the failed records of the same job)."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.db import transaction

from portal.audit.services import audit_record
from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.services.input_access import tenant_input_roots
from portal.jobs.services.submit import job_submit


def job_rerun(*, job: Job, actor: User | None) -> Job:
    """Submit a new job with the tenant, model, input, params, formats and shard size of `job`, and a
    deadline as long as the one it was given (counted from now).

    Goes through `job_submit`, so the input is checked again, held to the tenant's input roots (an
    operator re-runs the tenant's job, not one of their own: a `file://` input swapped since for a link
    out of the roots is refused), and the tenant's quota applies; raises `SubmissionError` (or
    `QuotaExceeded`) as a submission would.
    """
    deadline_seconds = (job.deadline_at - job.created_at).total_seconds() if job.deadline_at else None
    with transaction.atomic():
        rerun = job_submit(
            tenant=job.tenant,
            user=actor,
            input_roots=tenant_input_roots(job.tenant),
            request=JobRequest(
                model_name=job.model.name,
                model_version=job.model.version,
                input_uri=job.input_uri,
                params=job.params,
                shard_size=job.shard_size,
                input_format=job.input_format,
                text_column=job.text_column,
                id_column=job.id_column,
                output_format=job.output_format,
                deadline_seconds=deadline_seconds,
            ),
        )
        audit_record(
            actor=actor,
            action="job.rerun",
            target=job,
            tenant=job.tenant,
            summary=f"job {job.id} re-run as job {rerun.id}",
        )
    return rerun
