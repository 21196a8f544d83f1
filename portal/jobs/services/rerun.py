"""Re-run: submit a job again as a new job, with the same input and settings (unlike `retry`, which
runs only the failed records of the same job), optionally with another model, model version or params.
The new job knows the job it re-runs (`Job.rerun_of`), and its comparison report is made against that
job's output (`portal.jobs.services.comparison`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction

from portal.audit.services import audit_record
from portal.catalog.selectors import tenant_model
from portal.jobs.models import Job
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.input_access import tenant_input_roots
from portal.jobs.services.submit import job_submit


@dataclass(frozen=True)
class RerunChanges:
    """What a re-run changes of the job it re-runs; nothing given, nothing changes."""

    model_name: str | None = None
    """Another catalog model, of the same task; unset: the job's own."""
    model_version: str | None = None
    """A version of the model; unset: the job's model's version when the model is the job's own, else the
    newest enabled version of the model named."""
    params: Mapping[str, Any] | None = field(default=None, hash=False)
    """Merged over the job's params: a key given replaces the job's value, a key given as null removes it
    (the model's default applies again), a key not given keeps the job's value."""


def rerun_params(old: Mapping[str, Any], changes: Mapping[str, Any] | None) -> dict[str, Any]:
    """`changes` merged over `old` (see `RerunChanges.params`)."""
    merged = dict(old)
    for key, value in (changes or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def _check_same_task(job: Job, name: str, version: str | None) -> None:
    """Refuse a model of another task than the job's, before its input is checked against that task's field
    (which would blame the input). An unknown name, or one the tenant's quota excludes (which must answer
    alike), is left to the submission to refuse."""
    model = tenant_model(job.tenant, name, version)
    if model is not None and model.task != job.model.task:
        raise SubmissionError(
            f"model {model.name} is a {model.task} model; job {job.id} ran a {job.model.task} model, and a "
            "re-run is compared with the job it re-runs",
            field="model",
        )


def job_rerun(*, job: Job, actor: User | None, changes: RerunChanges | None = None) -> Job:
    """Submit a new job with the tenant, model, input, params, formats and shard size of `job` (with
    `changes` applied), and a deadline as long as the one it was given (counted from now); the new job's
    `rerun_of` is `job`.

    Goes through `job_submit`, so the input is checked again, held to the tenant's input roots (an
    operator re-runs the tenant's job, not one of their own: a `file://` input swapped since for a link
    out of the roots is refused), and the tenant's quota applies; raises `SubmissionError` (or
    `QuotaExceeded`) as a submission would, and `SubmissionError` naming `model` for a model of another
    task than the job's (the comparison needs outputs of one kind).
    """
    changes = changes or RerunChanges()
    deadline_seconds = (job.deadline_at - job.created_at).total_seconds() if job.deadline_at else None
    same_model = changes.model_name is None or changes.model_name == job.model.name
    model_name = changes.model_name or job.model.name
    model_version = changes.model_version or (job.model.version if same_model else None)
    _check_same_task(job, model_name, model_version)
    with transaction.atomic():
        rerun = job_submit(
            tenant=job.tenant,
            user=actor,
            input_roots=tenant_input_roots(job.tenant),
            request=JobRequest(
                model_name=model_name,
                model_version=model_version,
                input_uri=job.input_uri,
                params=rerun_params(job.params, changes.params),
                shard_size=job.shard_size,
                input_format=job.input_format,
                text_column=job.text_column,
                id_column=job.id_column,
                output_format=job.output_format,
                deadline_seconds=deadline_seconds,
            ),
        )
        Job.objects.filter(pk=rerun.pk).update(rerun_of=job)
        rerun.rerun_of = job
        changed = {
            name: [before, after]
            for name, before, after in (
                ("model", f"{job.model.name}@{job.model.version}", f"{rerun.model.name}@{rerun.model.version}"),
                ("params", job.params, rerun.params),
            )
            if before != after
        }
        audit_record(
            actor=actor,
            action="job.rerun",
            target=job,
            tenant=job.tenant,
            summary=f"job {job.id} re-run as job {rerun.id}",
            changes=changed,
        )
    return rerun
