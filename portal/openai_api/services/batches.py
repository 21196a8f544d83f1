"""`/v1/batches`: a batch is checked and converted into a Batchery job (a large input file by a task on
the validation queue, `validation.py`), cancelled through it, and finalized into OpenAI's output and error files once
the job has ended."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Mapping
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from portal.audit.services import audit_record
from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded, quota_hold_pending
from portal.jobs.requests import SubmissionError
from portal.jobs.services.stop import CannotStop, job_cancel
from portal.openai_api.formats.endpoints import UnsupportedEndpoint, endpoint_for
from portal.openai_api.formats.input_file import problems_to_openai_errors
from portal.openai_api.formats.output_file import convert_outputs, system_fingerprint
from portal.openai_api.models import Batch, File
from portal.openai_api.selectors import batch_status
from portal.openai_api.services.expiry import ExpiryRefused, expires_at, expiry_seconds
from portal.openai_api.services.validation import (
    VALIDATING,
    batch_input_convert,
    batch_job_submit,
    batch_prefix,
    submission_param,
    validation_task_id,
)
from portal.tenancy.models import Tenant
from portal.webhooks.services.events import webhook_batch_ended
from tasks import send
from tasks.shared.storage import join_uri, store_for

logger = logging.getLogger(__name__)

WINDOW_PATTERN = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_HOURS = 168
# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchRefused(Exception):
    """The request to create a batch is invalid; nothing was created."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


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
    """Check the request and start validating the input file. A file up to
    `BATCHERY_BATCH_SYNC_VALIDATION_BYTES` is validated here: its job is started, or a file with bad
    lines gives a batch that has `failed`. A larger one gives a batch that reads `validating` while the
    task `batchery.validate_batch` validates it (on the `validation` queue); while it does, it counts
    against the tenant's `max_concurrent_jobs`. Its output and error files expire as
    `output_expires_after` (OpenAI's policy) says.

    Raises `BatchRefused` for an invalid request, `QuotaExceeded` when a quota refuses the job of a file
    validated here or `max_concurrent_jobs` has no room for a larger file's validation (a quota that
    refuses its job once validated fails the batch with the quota's error instead).
    """
    try:
        endpoint_for(endpoint)
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
    if source_file.bytes > settings.BATCHERY_BATCH_SYNC_VALIDATION_BYTES:
        # Converting a large file takes longer than a request may: the batch is saved without a job
        # (`validating`) and the validation queue validates it; the reconciler resends a lost message.
        # A batch validating counts as a job under max_concurrent_jobs: one file posted a thousand times
        # queues no more validations than the tenant may run jobs.
        with transaction.atomic():
            quota_hold_pending(
                tenant,
                pending=lambda: Batch.objects.filter(VALIDATING, tenant=tenant).count(),
                what="batches validating",
            )
            batch.save()
            transaction.on_commit(partial(_send_validation, batch.id))
        return batch
    return _validate_now(batch, source_file, window)


def _send_validation(batch_id: str) -> None:
    try:
        send.send_batch_validation(batch_id, task_id=validation_task_id(batch_id))
    except Exception:
        # The batch is committed: the reconciler sends its validation once it has waited too long.
        logger.warning("validation of batch %s not enqueued; the reconciler sends it", batch_id, exc_info=True)


def _validate_now(batch: Batch, source_file: File, window_s: int) -> Batch:
    """Validate a small input file within the request; refusals of its job are the caller's HTTP errors."""
    job_input = join_uri(batch_prefix(batch.id), "input.jsonl")
    conversion = batch_input_convert(
        source_uri=source_file.uri, job_input=job_input, endpoint=batch.endpoint, tenant=batch.tenant
    )
    if not conversion.ok:
        batch.validation_errors = problems_to_openai_errors(conversion.problems)
        batch.finalized_at = timezone.now()
        batch.save()
        webhook_batch_ended(batch=batch)
        return batch
    try:
        with transaction.atomic():
            batch.job = batch_job_submit(
                batch=batch, conversion=conversion, job_input=job_input, deadline_seconds=window_s
            )
            batch.save()
    except QuotaExceeded:
        store_for(job_input).delete_prefix(job_input)
        raise
    except SubmissionError as exc:
        store_for(job_input).delete_prefix(job_input)
        raise BatchRefused(exc.message, param=submission_param(exc)) from None
    return batch


def batch_cancel(*, batch: Batch, actor: User | None = None) -> Batch:
    """Cancel the batch: one still validating ends `cancelled` at once (its validation then submits
    nothing), else its job is cancelled. Raises `CannotStop` if it has ended. `actor` is who asked."""
    if batch.job_id is None:
        now = timezone.now()
        with transaction.atomic():
            # The same condition the validation settles under, and the update waits for its row lock:
            # one of the two wins, so a cancelled batch never gets a job.
            if Batch.objects.filter(VALIDATING, pk=batch.pk).update(cancelled_at=now, finalized_at=now):
                cancelled = Batch.objects.select_related("job", "tenant").get(pk=batch.pk)
                audit_record(
                    actor=actor,
                    action="batch.cancelled",
                    target=cancelled,
                    tenant=cancelled.tenant,
                    summary=f"batch {batch.id} cancelled while validating",
                )
                webhook_batch_ended(batch=cancelled)
                return cancelled
        # Its validation settled it meanwhile: a job to cancel, or an ending.
        batch = Batch.objects.select_related("job").get(pk=batch.pk)
    if batch.job is None:
        raise CannotStop(f"batch {batch.id} has ended ({batch_status(batch)}) and has nothing to cancel")
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
    prefix = batch_prefix(batch.id)
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
            system_fingerprint=system_fingerprint(job.model.engine, job.model.name, job.model.version),
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
