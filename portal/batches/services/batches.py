"""`/v1/batches`: a batch is checked and converted into a Batchery job, cancelled through it, and
finalized into OpenAI's output and error files once the job has ended."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from portal.batches.formats import (
    DimensionsCheck,
    UnsupportedEndpoint,
    convert_outputs,
    convert_requests,
    endpoint_for,
    problems_to_openai_errors,
)
from portal.batches.models import Batch, File
from portal.batches.services.expiry import ExpiryRefused, expires_at, expiry_seconds
from portal.catalog.models import Model
from portal.catalog.selectors import newest_enabled_model
from portal.jobs.models import Job
from portal.jobs.services.stop import job_cancel
from portal.jobs.services.submit import QuotaExceeded, SubmissionError, job_submit
from portal.tenancy.models import Tenant
from portal.webhooks.services.events import webhook_batch_ended
from tasks.formats.jsonl import MAX_LINE_BYTES
from tasks.storage import join_uri, store_for

WINDOW_PATTERN = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_HOURS = 168
# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchRefused(Exception):
    """The request to create a batch is invalid; nothing was created."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def _batch_prefix(batch_id: str) -> str:
    return join_uri(settings.BATCHERY_STORAGE_URL, "batches", batch_id)


def _window_seconds(window: str) -> int:
    match = WINDOW_PATTERN.match(window)
    if match is None or int(match.group(1)) > MAX_WINDOW_HOURS:
        raise BatchRefused(
            f"completion_window must be hours such as '24h' (at most {MAX_WINDOW_HOURS}h), not {window!r}",
            param="completion_window",
        )
    return int(match.group(1)) * 3600


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise BatchRefused("metadata must be an object of strings", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BatchRefused(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise BatchRefused(
                f"metadata[{key!r}]: keys are strings up to {MAX_METADATA_KEY} characters, values strings up to "
                f"{MAX_METADATA_VALUE}",
                param="metadata",
            )
    return dict(metadata)


def _catalog_dimensions_problem() -> DimensionsCheck:
    """`convert_requests`' judge of ``dimensions``: the catalog entry the request's model names, looked up once."""
    models: dict[str, Model | None] = {}

    def problem(name: str, dimensions: Any) -> str | None:
        if name not in models:
            models[name] = newest_enabled_model(name)
        model = models[name]
        # No such model: the submission refuses the batch naming body.model.
        return None if model is None else model.dimensions_problem(dimensions)

    return problem


def batch_create(
    *,
    tenant: Tenant,
    user: User | None,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: Any = None,
    output_expires_after: Mapping[str, Any] | None = None,
) -> Batch:
    """Check the input file and start its job; a file with bad lines gives a batch that has `failed`.
    Its output and error files expire as `output_expires_after` (OpenAI's policy) says.

    Raises `BatchRefused` for an invalid request, `QuotaExceeded` when a quota refuses the job.
    """
    try:
        served = endpoint_for(endpoint)
    except UnsupportedEndpoint as exc:
        raise BatchRefused(str(exc), param="endpoint") from None
    window = _window_seconds(completion_window)
    checked_metadata = _check_metadata(metadata)
    try:
        output_expiry = expiry_seconds(output_expires_after, field="output_expires_after")
    except ExpiryRefused as exc:
        raise BatchRefused(str(exc), param=exc.param) from None
    source_file = File.objects.unexpired().filter(tenant=tenant, pk=input_file_id, purpose=File.Purpose.BATCH).first()
    if source_file is None:
        raise BatchRefused(f"no batch input file {input_file_id!r}", param="input_file_id")

    batch = Batch(
        id=f"batch_{secrets.token_hex(12)}",
        tenant=tenant,
        created_by=user,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=checked_metadata,
        input_file_id=source_file.id,
        output_expires_after_seconds=output_expiry,
    )
    job_input = join_uri(_batch_prefix(batch.id), "input.jsonl")
    store = store_for(job_input)
    with store_for(source_file.uri).open_read(source_file.uri) as source, store.open_write(job_input) as target:
        conversion = convert_requests(
            iter(partial(source.readline, MAX_LINE_BYTES + 1), b""),
            target,
            endpoint=endpoint,
            max_problems=settings.BATCHERY_MAX_REPORTED_PROBLEMS,
            max_line_bytes=MAX_LINE_BYTES,
            dimensions_problem=_catalog_dimensions_problem(),
        )
    if not conversion.ok or conversion.model is None:
        store.delete_prefix(job_input)
        batch.validation_errors = problems_to_openai_errors(conversion.problems)
        batch.finalized_at = timezone.now()
        batch.save()
        webhook_batch_ended(batch=batch)
        return batch
    try:
        with transaction.atomic():
            batch.job = job_submit(
                tenant=tenant,
                user=user,
                model_name=conversion.model,
                input_uri=job_input,
                # `dimensions` shortens embeddings on the worker; `encoding_format` (which engines ignore)
                # is read back at finalize.
                params=conversion.params,
                deadline_seconds=window,
                task=served.task,
            )
            batch.save()
    except QuotaExceeded:
        store.delete_prefix(job_input)
        raise
    except SubmissionError as exc:
        store.delete_prefix(job_input)
        param = "body.model" if exc.field == "model" else exc.field
        raise BatchRefused(exc.message, param=param) from None
    return batch


def batch_cancel(*, batch: Batch, actor: User | None = None) -> Batch:
    """Cancel the batch's job; raises `CannotStop` if it has ended (or never ran). `actor` is who asked."""
    from portal.jobs.services.stop import CannotStop

    if batch.job is None:
        raise CannotStop(f"batch {batch.id} failed validation and has nothing to cancel")
    job_cancel(job=batch.job, actor=actor)
    return Batch.objects.select_related("job").get(pk=batch.pk)


def _derived_file_id(batch_id: str, kind: str) -> str:
    # The same id on every run, so a finalize that runs twice writes the same files.
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def batch_finalize(*, batch_id: str) -> bool:
    """Write the OpenAI output and error files of a batch whose job has ended; True if this call did."""
    batch = Batch.objects.select_related("job__model").get(pk=batch_id)
    job: Job | None = batch.job
    if batch.finalized_at is not None or job is None or not job.is_finished:
        return False
    files: dict[str, File] = {}
    if job.shard_count:
        files = _write_output_files(batch, job)
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch_id)
        if locked.finalized_at is not None:
            return False
        for file in files.values():
            file.save()
        locked.output_file = files.get("output")
        locked.error_file = files.get("errors")
        locked.finalized_at = timezone.now()
        locked.save(update_fields=["output_file", "error_file", "finalized_at"])
        webhook_batch_ended(batch=locked)
    return True


def _write_output_files(batch: Batch, job: Job) -> dict[str, File]:
    prefix = _batch_prefix(batch.id)
    output_uri, errors_uri = join_uri(prefix, "output.jsonl"), join_uri(prefix, "errors.jsonl")
    store = store_for(output_uri)
    with (
        store_for(job.output_uri).open_read(job.output_uri) as source,
        store.open_write(output_uri) as output,
        store.open_write(errors_uri) as errors,
    ):
        counts = convert_outputs(
            source,
            output,
            errors,
            endpoint=batch.endpoint,
            model=job.model.name,
            batch_id=batch.id,
            created=int(job.created_at.timestamp()),
            encoding_format=str(job.params.get("encoding_format", "float")),
        )
    files = {}
    now = timezone.now()
    for kind, uri, count in (("output", output_uri, counts.completed), ("errors", errors_uri, counts.failed)):
        if count:
            files[kind] = File(
                id=_derived_file_id(batch.id, kind),
                tenant_id=batch.tenant_id,
                purpose=File.Purpose.BATCH_OUTPUT,
                filename=f"{batch.id}_{kind}.jsonl",
                bytes=store.size(uri),
                uri=uri,
                created_at=now,
                # OpenAI anchors `output_expires_after` at the file's creation, not the batch's.
                expires_at=expires_at(now, batch.output_expires_after_seconds),
            )
    return files
