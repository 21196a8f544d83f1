"""Validation of a `/v1/batches` input file: every line checked and converted into a Batchery job's
input, then the job submitted.

A small file is validated within the create request (`batch_create`); a larger one by the
`batchery.validate_batch` task on the `validation` queue (`batch_validate`), while the batch reads
`validating` (and counts against the tenant's `max_concurrent_jobs`, see `batch_create`). There a
refusal that the request would have answered with an HTTP error (bad lines, a quota, a refused
submission) ends the batch `failed` with OpenAI's `errors.data` instead, as OpenAI's own batches do.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Mapping
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from gpuworkers.engines.media import MODALITIES, MediaPolicy, MediaProblem, messages_media_problem
from gpuworkers.engines.request_params import check_request_params
from gpuworkers.engines.sampling import ParamError
from portal.catalog.models import Model
from portal.jobs.adapters import model_runs_on
from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.submit import job_submit
from portal.openai_api.formats.endpoints import endpoint_for
from portal.openai_api.formats.input_file import RequestConversion, convert_requests, problems_to_openai_errors
from portal.openai_api.models import Batch, File
from portal.tenancy.models import Tenant
from portal.webhooks.services.events import webhook_batch_ended
from tasks.shared.formats.jsonl import MAX_LINE_BYTES
from tasks.shared.leases import Lease, LeaseHeld, job_lease_key
from tasks.shared.storage import join_uri, store_for

logger = logging.getLogger(__name__)

# A batch no one has validated, failed, cancelled or given a job yet: OpenAI's `validating`.
VALIDATING = Q(job__isnull=True, validation_errors__isnull=True, finalized_at__isnull=True)


def batch_prefix(batch_id: str) -> str:
    """Where a batch's own objects live: the job input converted from its file, its output files."""
    return join_uri(settings.BATCHERY_STORAGE_URL, "batches", batch_id)


def validation_lease_key(batch_id: str) -> str:
    return job_lease_key("validate", batch_id)


def validation_task_id(batch_id: str) -> str:
    """One task id per batch, so that the reconciler can tell a validation still waiting in the broker."""
    return f"validate-{batch_id}"


class _CatalogChecks:
    """`convert_requests`' checks of ``dimensions`` and of params, and what each request's model runs on: the
    catalog entry each request's model names (or its adapter's base model, for the batch's tenant), looked up
    once per name. No such model: the submission refuses the batch naming body.model."""

    def __init__(self, tenant: Tenant) -> None:
        self._tenant = tenant
        self._models: dict[str, Model | None] = {}
        self._media: dict[str, MediaPolicy] = {}

    def _model(self, name: str) -> Model | None:
        if name not in self._models:
            self._models[name] = model_runs_on(self._tenant, name)
        return self._models[name]

    def base_model(self, name: str) -> str | None:
        model = self._model(name)
        return None if model is None else model.name

    def dimensions_problem(self, name: str, dimensions: Any) -> str | None:
        model = self._model(name)
        return None if model is None else model.dimensions_problem(dimensions)

    def media_problem(self, name: str, messages: list[Any], field: str) -> MediaProblem | None:
        if name not in self._media:
            model = self._model(name)
            self._media[name] = MediaPolicy.configured(MODALITIES if model is None else model.input_modalities)
        return messages_media_problem(messages, self._media[name], field=field)

    def params_problem(self, name: str, params: Mapping[str, Any]) -> tuple[str, str] | None:
        model = self._model(name)
        if model is None:
            return None
        try:
            check_request_params(model.engine, model.task, params, tool_parser=model.tool_parser)
        except ParamError as exc:
            return exc.field, str(exc)
        return None


def batch_input_convert(*, source_uri: str, job_input: str, endpoint: str, tenant: Tenant) -> RequestConversion:
    """Check the input file at `source_uri` line by line and write its requests to `job_input` as Batchery
    records (lines may name the batch's model or LoRA adapters of it that `tenant` may use); `job_input` is
    deleted again when the file has bad lines."""
    store = store_for(job_input)
    checks = _CatalogChecks(tenant)
    with store_for(source_uri).open_read(source_uri) as source, store.open_write(job_input) as target:
        conversion = convert_requests(
            iter(partial(source.readline, MAX_LINE_BYTES + 1), b""),
            target,
            endpoint=endpoint,
            max_problems=settings.BATCHERY_MAX_REPORTED_PROBLEMS,
            max_line_bytes=MAX_LINE_BYTES,
            dimensions_problem=checks.dimensions_problem,
            params_problem=checks.params_problem,
            base_model=checks.base_model,
            media_problem=checks.media_problem,
        )
    if not conversion.ok or conversion.model is None:
        store.delete_prefix(job_input)
    return conversion


def batch_job_submit(*, batch: Batch, conversion: RequestConversion, job_input: str, deadline_seconds: float) -> Job:
    """Submit the job of a batch whose file converted cleanly; raises `SubmissionError` (`QuotaExceeded`)."""
    assert conversion.model is not None  # a clean conversion names its model
    return job_submit(
        tenant=batch.tenant,
        user=batch.created_by,
        task=endpoint_for(batch.endpoint).task,
        request=JobRequest(
            model_name=conversion.model,
            input_uri=job_input,
            params=conversion.params,
            deadline_seconds=deadline_seconds,
        ),
    )


def submission_param(exc: SubmissionError) -> str:
    """The request field a refused submission names, as the batch's caller wrote it."""
    return "body.model" if exc.field == "model" else exc.field


def _submission_errors(exc: SubmissionError) -> dict[str, Any]:
    """A refused submission as OpenAI's `errors` object: what the create request's 429 or 400 would have said."""
    data: list[dict[str, Any]]
    if isinstance(exc, QuotaExceeded):
        data = [{"code": "quota_exceeded", "message": exc.message, "param": exc.quota, "line": None}]
    else:
        data = [{"code": "invalid_request", "message": exc.message, "param": submission_param(exc), "line": None}]
        data += [
            {"code": "invalid_input", "message": problem.message, "param": None, "line": problem.line}
            for problem in exc.problems
        ]
    return {"object": "list", "data": data}


def _fail_locked(batch: Batch, errors: dict[str, Any]) -> None:
    """End a validating batch `failed`; the caller holds its row. Its webhook goes after commit."""
    batch.validation_errors = errors
    batch.finalized_at = timezone.now()
    batch.save(update_fields=["validation_errors", "finalized_at"])
    webhook_batch_ended(batch=batch)


def batch_validation_fail(*, batch_id: str, errors: dict[str, Any]) -> bool:
    """End a batch still validating `failed` with `errors`; True if this call did (not one that has ended)."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(VALIDATING, pk=batch_id).first()
        if batch is None:
            return False
        _fail_locked(batch, errors)
    return True


def _remaining_window_s(batch: Batch, now: dt.datetime) -> float:
    # OpenAI counts the completion window from the batch's creation, validation included.
    window_s = int(batch.completion_window.rstrip("h")) * 3600  # checked by `batch_create`
    return max(1.0, window_s - (now - batch.created_at).total_seconds())


def batch_validate(*, batch_id: str, worker: str = "") -> bool:
    """Validate a batch that reads `validating` (the validation task's side of `batch_create`): submit its job,
    or end it `failed` with line-numbered `errors`. True if this call settled it.

    A second run, redelivered or sent again by the reconciler, does nothing: one holding the lease
    makes another return at once, and the batch row, locked to settle it, must still be validating.
    """
    batch = Batch.objects.select_related("tenant", "created_by").filter(VALIDATING, pk=batch_id).first()
    if batch is None:
        return False
    try:
        with Lease(validation_lease_key(batch_id), worker or "validate", exclusive=True):
            return _validate(batch)
    except LeaseHeld as exc:
        logger.info("batch %s is being validated by %s; leaving it", batch_id, exc.holder)
        return False


def _validate(batch: Batch) -> bool:
    # The file is read whatever its expiry: the expiry sweep keeps it while a batch still validates.
    source = File.objects.filter(tenant_id=batch.tenant_id, pk=batch.input_file_id).first()
    if source is None:
        missing = {
            "code": "invalid_file",
            "message": f"the input file {batch.input_file_id} was deleted before the batch was validated",
            "param": "input_file_id",
            "line": None,
        }
        return batch_validation_fail(batch_id=batch.id, errors={"object": "list", "data": [missing]})
    # A name of its own per run: should two runs ever overlap (Redis down, no lease), neither
    # overwrites the input of the job that the other submitted.
    job_input = join_uri(batch_prefix(batch.id), f"input-{secrets.token_hex(4)}.jsonl")
    conversion = batch_input_convert(
        source_uri=source.uri, job_input=job_input, endpoint=batch.endpoint, tenant=batch.tenant
    )
    outcome = _settle(batch, conversion, job_input)
    if outcome != "submitted" and conversion.ok:
        store_for(job_input).delete_prefix(job_input)  # a failed batch's bad lines deleted it already
    logger.info("batch %s validation: %s", batch.id, outcome)
    return outcome != "left"


def _settle(batch: Batch, conversion: RequestConversion, job_input: str) -> str:
    """Submit the job or fail the batch, its row locked: `submitted`, `failed`, or `left` when it had
    been cancelled or settled by another run meanwhile."""
    with transaction.atomic():
        locked = Batch.objects.select_for_update().filter(VALIDATING, pk=batch.id).first()
        if locked is None:
            return "left"
        if not conversion.ok:
            _fail_locked(locked, problems_to_openai_errors(conversion.problems))
            return "failed"
        try:
            # A savepoint: a refused submission leaves nothing of its job, and the batch is failed instead.
            with transaction.atomic():
                locked.job = batch_job_submit(
                    batch=batch,
                    conversion=conversion,
                    job_input=job_input,
                    deadline_seconds=_remaining_window_s(batch, timezone.now()),
                )
                locked.save(update_fields=["job"])
        except SubmissionError as exc:
            _fail_locked(locked, _submission_errors(exc))
            return "failed"
        return "submitted"


def batches_validation_stalled(*, now: dt.datetime) -> list[str]:
    """Batches still validating `BATCHERY_BATCH_VALIDATION_RESEND_S` after their creation: the reconciler
    sends their validation again unless it is held or waiting in the broker."""
    created_before = now - dt.timedelta(seconds=settings.BATCHERY_BATCH_VALIDATION_RESEND_S)
    return list(Batch.objects.filter(VALIDATING, created_at__lte=created_before).values_list("id", flat=True))
