"""Submission: the one service every entry point calls (CLI, REST, OpenAI batches, portal form).

It checks the request and, for inputs small enough, every input line; reserves quota with the
tenant's quota row locked; creates the job; and enqueues planning once the transaction commits.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from portal.catalog.models import Model
from portal.catalog.selectors import models_for_tenant
from portal.jobs.models import Job, JobEvent, JobStatus
from portal.jobs.selectors import quota_usage
from portal.jobs.services.input_access import input_refusal
from portal.jobs.services.storage_layout import errors_uri, output_uri
from portal.tenancy.models import Quota, Tenant
from tasks.formats.inputs import InputOptions, InputOptionsError, check_input
from tasks.formats.records import LineProblem, input_field_for
from tasks.storage import StorageError, store_for

SAMPLE_BYTES = 64 * 1024
OUTPUT_FORMATS = ("jsonl", "parquet")


class SubmissionError(Exception):
    """The request cannot be accepted; `field` names the part of it that is wrong."""

    def __init__(self, message: str, *, field: str, problems: Sequence[LineProblem] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.problems = list(problems)


class QuotaExceeded(SubmissionError):
    """A limit of the tenant's quota refuses the job: `limit` is the limit, `current` the use so far."""

    def __init__(
        self, *, quota: str, limit: float | list[str], current: float | str, requested: float | str, message: str = ""
    ) -> None:
        super().__init__(
            message or f"quota {quota} exceeded: limit {limit}, in use {current}, this job needs {requested}",
            field=quota,
        )
        self.quota = quota
        self.limit = limit
        self.current = current
        self.requested = requested


@dataclass(frozen=True)
class InputCheck:
    size: int
    """Bytes in the input."""
    records: int | None
    """Valid records, when the input was small enough to check at submission."""


def normalize_input_uri(value: str) -> str:
    """Accept a URI or a local path; a path becomes an absolute file:// URI."""
    if not value:
        raise SubmissionError("an input is required", field="input")
    if urlparse(value).scheme in ("", "file") and not value.startswith("file://"):
        return Path(value).expanduser().resolve().as_uri()
    return value


def _resolve_model(tenant: Tenant, name: str, version: str | None) -> Model:
    """The newest enabled model of that name (and version); refused if the tenant's quota excludes it."""
    allowed = models_for_tenant(tenant)
    models = Model.objects.select_related("gpu_class").filter(name=name, enabled=True)
    if version:
        models = models.filter(version=version)
    model = models.order_by("-created_at").first()
    if model is None:
        known = ", ".join(sorted(set(allowed.values_list("name", flat=True))))
        raise SubmissionError(f"no enabled model named {name!r}; available: {known or 'none'}", field="model")
    if not allowed.filter(pk=model.pk).exists():
        names = sorted(set(allowed.values_list("name", flat=True)))
        quota = Quota.objects.get(tenant=tenant)
        which = "allowed_models" if quota.allowed_models.exists() else "allowed_gpu_classes"
        raise QuotaExceeded(
            quota=which,
            limit=names,
            current=str(model),
            requested=str(model),
            message=f"quota {which}: model {model} is not allowed for this tenant; "
            f"allowed: {', '.join(names) or 'none'}",
        )
    return model


def _check_input(input_uri: str, *, input_field: str, options: InputOptions) -> InputCheck:
    try:
        store = store_for(input_uri)
        size = store.size(input_uri)
    except StorageError as exc:
        raise SubmissionError(f"cannot read the input: {exc}", field="input") from None
    if size > settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES:
        return InputCheck(size=size, records=None)
    limit = settings.BATCHERY_MAX_REPORTED_PROBLEMS
    try:
        check = check_input(
            lambda: store.open_read(input_uri),
            uri=input_uri,
            options=options,
            input_field=input_field,
            max_problems=limit,
        )
    except InputOptionsError as exc:
        raise SubmissionError(str(exc), field=exc.option) from None
    except StorageError as exc:
        raise SubmissionError(f"cannot read the input: {exc}", field="input") from None
    if not check.ok:
        raise SubmissionError(f"input rejected: {check.summary(limit=limit)}", field="input", problems=check.problems)
    return InputCheck(size=size, records=check.records)


def _parquet_rows(input_uri: str) -> int | None:
    """The row count in a Parquet file's footer, where the store's reader can seek to it."""
    import pyarrow.parquet as pq

    with store_for(input_uri).open_read(input_uri) as stream:
        if not stream.seekable():
            return None
        return int(pq.ParquetFile(stream).metadata.num_rows)


def _estimate_records(input_uri: str, size: int) -> int:
    """Records in an input too large to check at submission, to choose a shard size: the row count of
    a Parquet file, else the size over the mean line length of the first 64 KiB (of the stored bytes:
    a compressed file is taken at its compressed size, which undercounts, and the shard size bounds
    keep that harmless)."""
    with store_for(input_uri).open_read(input_uri) as stream:
        sample = stream.read(SAMPLE_BYTES)
    if sample.startswith(b"PAR1") and (rows := _parquet_rows(input_uri)) is not None:
        return max(1, rows)
    lines = max(sample.count(b"\n"), 1)
    return max(1, round(size / max(len(sample) / lines, 1)))


def default_shard_size(records: int) -> int:
    """Enough shards to spread a job over the fleet, none so small that overhead dominates."""
    per_shard = math.ceil(records / settings.BATCHERY_TARGET_SHARDS)
    return max(settings.BATCHERY_MIN_SHARD_RECORDS, min(settings.BATCHERY_MAX_SHARD_RECORDS, per_shard))


def _check_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise SubmissionError("params must be a JSON object", field="params")
    return dict(params)


def _reserve_quota(tenant: Tenant, *, input_bytes: int, records: int | None) -> None:
    """Check the tenant's limits with its quota row locked, so concurrent submissions queue up here."""
    Quota.objects.get_or_create(tenant=tenant)
    quota = Quota.objects.select_for_update().get(tenant=tenant)
    if quota.max_input_bytes is not None and input_bytes > quota.max_input_bytes:
        raise QuotaExceeded(quota="max_input_bytes", limit=quota.max_input_bytes, current=0, requested=input_bytes)
    use = quota_usage(tenant_ids=[tenant.pk])[tenant.pk]
    if quota.max_concurrent_jobs is not None and use.concurrent_jobs + 1 > quota.max_concurrent_jobs:
        raise QuotaExceeded(
            quota="max_concurrent_jobs", limit=quota.max_concurrent_jobs, current=use.concurrent_jobs, requested=1
        )
    if quota.gpu_seconds_per_month is not None and use.gpu_seconds_this_month >= quota.gpu_seconds_per_month:
        raise QuotaExceeded(
            quota="gpu_seconds_per_month",
            limit=quota.gpu_seconds_per_month,
            current=round(use.gpu_seconds_this_month, 1),
            requested=0,
            message=f"quota gpu_seconds_per_month exhausted: limit {quota.gpu_seconds_per_month}, "
            f"used {use.gpu_seconds_this_month:.1f} this month",
        )
    if (
        quota.max_queued_records is not None
        and records is not None
        and use.queued_records + records > quota.max_queued_records
    ):
        raise QuotaExceeded(
            quota="max_queued_records", limit=quota.max_queued_records, current=use.queued_records, requested=records
        )


def job_submit(
    *,
    tenant: Tenant,
    model_name: str,
    input_uri: str,
    user: User | None = None,
    model_version: str | None = None,
    params: Mapping[str, Any] | None = None,
    shard_size: int | None = None,
    deadline_seconds: float | None = None,
    input_roots: Sequence[str] | None = None,
    task: str | None = None,
    input_format: str = "auto",
    text_column: str = "",
    id_column: str = "",
    output_format: str = "jsonl",
    priority: int | None = None,
) -> Job:
    """Accept a job or raise `SubmissionError` naming what is wrong (the field, the input lines).

    `input_roots`, when given, confines the input to those URI prefixes: callers acting for a tenant
    (the API) pass them; the operators' CLI does not. `task`, when given, is the task the model must
    serve (an OpenAI endpoint needs one).
    """
    model = _resolve_model(tenant, model_name, model_version)
    if task is not None and model.task != task:
        raise SubmissionError(
            f"model {model.name!r} serves task {model.task!r}; this needs a {task!r} model", field="model"
        )
    job_params = _check_params(params)
    try:
        options = InputOptions(format=input_format, text_column=text_column or None, id_column=id_column or None)
    except InputOptionsError as exc:
        raise SubmissionError(str(exc), field=exc.option) from None
    if output_format not in OUTPUT_FORMATS:
        raise SubmissionError(
            f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, not {output_format!r}", field="output_format"
        )
    if priority is not None and not 0 <= priority <= tenant.priority:
        raise SubmissionError(
            f"priority must be from 0 to {tenant.priority} (the tenant's own priority), not {priority}",
            field="priority",
        )
    if shard_size is not None and shard_size < 1:
        raise SubmissionError("shard_size must be a positive number of records", field="shard_size")
    if deadline_seconds is not None and deadline_seconds <= 0:
        raise SubmissionError("the deadline must be a positive number of seconds", field="deadline_seconds")
    uri = normalize_input_uri(input_uri)
    if input_roots is not None and (refusal := input_refusal(uri, input_roots)):
        raise SubmissionError(refusal, field="input")
    checked = _check_input(uri, input_field=input_field_for(model.task), options=options)
    records = checked.records if checked.records is not None else _estimate_records(uri, checked.size)

    from tasks.plan import plan_job

    job_id = str(uuid.uuid4())
    with transaction.atomic():
        _reserve_quota(tenant, input_bytes=checked.size, records=checked.records)
        job = Job.objects.create(
            id=job_id,
            tenant=tenant,
            created_by=user,
            model=model,
            input_uri=uri,
            input_bytes=checked.size,
            params=job_params,
            input_format=input_format,
            text_column=text_column,
            id_column=id_column,
            output_format=output_format,
            priority=priority,
            shard_size=shard_size or default_shard_size(records),
            total_records=checked.records,
            output_uri=output_uri(job_id),
            errors_uri=errors_uri(job_id),
            deadline_at=timezone.now() + dt.timedelta(seconds=deadline_seconds) if deadline_seconds else None,
        )
        JobEvent.objects.create(job=job, status=JobStatus.QUEUED)
        transaction.on_commit(lambda: plan_job.apply_async((job_id,), task_id=f"plan-{job_id}"))
    return job
