"""Submission: the one service every entry point calls (CLI, REST, OpenAI batches, portal form).

It checks the request (`request_checks.py`) and, for inputs small enough, every input line; holds the
job's cost hold against the tenant's monthly budget where it has one; reserves quota with the
tenant's quota row locked; creates the job; and enqueues planning once the transaction commits. The
checks, the quota rules and the job as it would be created are shared with the dry run (`dry_run.py`),
which stores nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from portal.jobs.budget import budget_reserve
from portal.jobs.models import Job, JobEvent, JobStatus
from portal.jobs.quota import input_limits, quota_reserve
from portal.jobs.record_checks import record_checks
from portal.jobs.requests import JobRequest
from portal.jobs.services.dry_run import job_dry_run
from portal.jobs.services.request_checks import InputCheck, input_errors, input_rejected, submission_request
from portal.tenancy.models import Quota, Tenant
from tasks import send
from tasks.shared.formats.compression import DecompressionLimitExceeded, DecompressionLimits
from tasks.shared.formats.inputs import InputOptions, check_input
from tasks.shared.formats.jsonl import JsonlCheck, RecordProblem
from tasks.shared.storage import input_open, store_for

SUBMIT_CHECK_DECOMPRESSED_BYTES = 64 * 1024 * 1024
"""A compressed input small enough to check at submission is checked there only while it expands to no
more than this (about a second of reading); past it, its planner checks it, as an input too large to
check, so that the request stays short."""
_LEFT_TO_THE_PLANNER = "the check at submission"


def input_read(
    input_uri: str,
    *,
    input_field: str,
    options: InputOptions,
    limits: DecompressionLimits | None = None,
    record_problem: RecordProblem | None = None,
) -> tuple[int, JsonlCheck | None]:
    """The input's size, and the check of every line where the input is small enough to check at
    submission (BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES); None: the planner checks it. Raises
    `SubmissionError` when the input cannot be read or the options do not fit its format,
    `InputTooLarge` (or `QuotaExceeded`) when a compressed input expands past `limits`."""
    with input_errors():
        size = store_for(input_uri).size(input_uri)
    if size > settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES:
        return size, None
    limits = limits or DecompressionLimits.configured()
    with input_errors():
        try:
            check = check_input(
                lambda: input_open(input_uri),
                uri=input_uri,
                options=options,
                input_field=input_field,
                max_problems=settings.BATCHERY_MAX_REPORTED_PROBLEMS,
                limits=limits.capped(SUBMIT_CHECK_DECOMPRESSED_BYTES, setting=_LEFT_TO_THE_PLANNER),
                record_problem=record_problem,
            )
        except DecompressionLimitExceeded as exc:
            if exc.setting != _LEFT_TO_THE_PLANNER:
                raise
            return size, None
    return size, check


def _check_input(
    input_uri: str, *, input_field: str, options: InputOptions, tenant: Tenant, record_problem: RecordProblem
) -> InputCheck:
    limits = input_limits(tenant.pk)
    size, check = input_read(
        input_uri, input_field=input_field, options=options, limits=limits, record_problem=record_problem
    )
    if check is not None and not check.ok:
        raise input_rejected(check)
    return InputCheck(size=size, records=check.records if check is not None else None)


def job_submit(
    *,
    tenant: Tenant,
    request: JobRequest,
    user: User | None = None,
    input_roots: Sequence[str] | None = None,
    task: str | None = None,
) -> Job:
    """Accept a job or raise `SubmissionError` naming what is wrong (the field, the input lines).

    The arguments are `submission_request`'s, and `user`, who submits.
    """
    accepted = submission_request(tenant=tenant, request=request, input_roots=input_roots, task=task)
    adapters = accepted.adapters()
    checked = _check_input(
        accepted.input_uri,
        input_field=accepted.input_field,
        options=accepted.options,
        tenant=tenant,
        record_problem=record_checks(accepted.model, adapters),
    )

    hold = _budget_hold(tenant=tenant, request=request, input_roots=input_roots, task=task)
    job_id = str(uuid.uuid4())
    with transaction.atomic():
        quota = quota_reserve(tenant, input_bytes=checked.size, records=checked.records)
        if hold is not None:
            budget_reserve(quota, job_id=job_id, hold=hold)
        job = accepted.job(checked, job_id=job_id, user=user)
        job.adapters = adapters.entries
        job.save(force_insert=True)
        JobEvent.objects.create(job=job, status=JobStatus.QUEUED)
        transaction.on_commit(lambda: send.send_plan(job_id, task_id=f"plan-{job_id}"))
    return job


def _budget_hold(
    *, tenant: Tenant, request: JobRequest, input_roots: Sequence[str] | None, task: str | None
) -> Decimal | None:
    """The dry run's budget hold of the request (`CostEstimate.hold`) where the tenant's quota sets a monthly
    budget; None where it sets none (nothing is held, and the dry run's read of the input is spared)."""
    if not Quota.objects.filter(tenant=tenant, monthly_budget__isnull=False).exists():
        return None
    return job_dry_run(tenant=tenant, request=request, input_roots=input_roots, task=task).cost.hold
