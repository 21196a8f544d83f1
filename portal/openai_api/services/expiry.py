"""Expiry of `/v1/files`: OpenAI's expiration policies checked, and the sweep that deletes what expired.

An upload expires `expires_after.seconds` after it was created; a batch's output and error files expire
`output_expires_after.seconds` after they were written (OpenAI anchors both at the file's `created_at`).
The sweep runs from the reconciler; for each expired file it deletes the storage objects first and the
row last, so a sweep that fails halfway leaves the row for the next sweep to find, never an orphan
object. The API stops showing a file once its `expires_at` has passed, whether or not the sweep has run.

An input file is not deleted while a batch that uses it has not ended: OpenAI keeps such a batch
working, and a batch still validating reads its input file. The file stays hidden from the API and
goes in the first sweep after its last batch has ended.
Likewise a batch's outputs wait while its job runs again (`retry` on the native API writes under the
job's root).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from portal.jobs.models import FINAL_STATUSES
from portal.jobs.storage_layout import job_root
from portal.openai_api.models import Batch, File
from tasks.shared.storage import join_uri, store_for

logger = logging.getLogger(__name__)

ANCHORS = ("created_at",)
# OpenAI's upper bound: 30 days. The lower bound, an hour at OpenAI, is the setting
# BATCHERY_FILE_EXPIRY_MIN_SECONDS, so that a test can see a file expire within a minute.
MAX_EXPIRY_SECONDS = 30 * 24 * 3600
# Rows handled per sweep, so that a backlog of expired files cannot make one reconcile sweep long.
SWEEP_LIMIT = 500


class ExpiryRefused(ValueError):
    """An expiration policy OpenAI would refuse; `param` names the field, e.g. `expires_after.seconds`."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def expiry_seconds(policy: Mapping[str, Any] | None, *, field: str) -> int | None:
    """The seconds of an expiration policy `{"anchor": "created_at", "seconds": N}` named `field`;
    None without one. Raises `ExpiryRefused` for an anchor OpenAI does not have or seconds out of range."""
    if policy is None:
        return None
    anchor, seconds = policy.get("anchor"), policy.get("seconds")
    if anchor not in ANCHORS:
        raise ExpiryRefused(f"{field}.anchor must be 'created_at', not {anchor!r}", param=f"{field}.anchor")
    low = settings.BATCHERY_FILE_EXPIRY_MIN_SECONDS
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not low <= seconds <= MAX_EXPIRY_SECONDS:
        raise ExpiryRefused(
            f"{field}.seconds must be an integer from {low} to {MAX_EXPIRY_SECONDS}, not {seconds!r}",
            param=f"{field}.seconds",
        )
    return seconds


def expires_at(created_at: dt.datetime, seconds: int | None) -> dt.datetime | None:
    return created_at + dt.timedelta(seconds=seconds) if seconds is not None else None


@dataclass
class ExpiryReport:
    files: int = 0
    """Expired files deleted, outputs of batches included."""
    batches: int = 0
    """Batches whose outputs (files and job objects) were deleted."""
    held: int = 0
    """Expired input files kept because a batch that uses them has not ended."""


def _delete_file(file: File) -> None:
    store_for(file.uri).delete_prefix(file.uri)
    File.objects.filter(pk=file.pk).delete()


def _expire_batch_outputs(batch: Batch) -> int:
    """Delete the batch's output and error files with everything its job wrote; the files' count.

    Both files are written together with the same `expires_at`, so they go together.
    """
    files = [file for file in (batch.output_file, batch.error_file) if file is not None]
    for file in files:
        store_for(file.uri).delete_prefix(file.uri)
    # The batch's own objects: the job's input converted from the upload, beside the two files.
    batch_prefix = join_uri(settings.BATCHERY_STORAGE_URL, "batches", batch.id)
    store_for(batch_prefix).delete_prefix(batch_prefix)
    job = batch.job
    if job is not None and job.output_uri:
        root = job_root(job)
        # The root is the folder of the job's output; checked, since deleting a wrong prefix loses others' data.
        if root.endswith(f"/{job.pk}"):
            store_for(root).delete_prefix(root)
    File.objects.filter(pk__in=[file.pk for file in files]).delete()
    return len(files)


def files_expire(*, now: dt.datetime | None = None) -> ExpiryReport:
    """Delete what expired by `now` (default: now): batch outputs, then uploads no running batch uses.

    Each batch and each file is handled on its own: one that fails is logged and tried again next sweep.
    """
    now = now or timezone.now()
    report = ExpiryReport()
    expired_outputs = Q(output_file__expires_at__lte=now) | Q(error_file__expires_at__lte=now)
    # A job run again by `retry` writes under its root: its outputs wait until it has ended again.
    ended = Q(job__isnull=True) | Q(job__status__in=FINAL_STATUSES)
    batches = Batch.objects.select_related("job", "output_file", "error_file").filter(expired_outputs, ended)
    for batch in batches.order_by("finalized_at")[:SWEEP_LIMIT]:
        try:
            report.files += _expire_batch_outputs(batch)
            report.batches += 1
        except Exception:
            logger.exception("expiry: deleting the outputs of batch %s failed; the next sweep tries again", batch.id)

    # Outputs go with their batch, above, so that none is deleted without its job's objects.
    expired = File.objects.filter(expires_at__lte=now).exclude(purpose=File.Purpose.BATCH_OUTPUT)
    files = list(expired.order_by("expires_at")[:SWEEP_LIMIT])
    running = Batch.objects.filter(finalized_at__isnull=True, input_file_id__in=[file.id for file in files])
    in_use = set(running.values_list("input_file_id", flat=True))
    for file in files:
        if file.id in in_use:
            report.held += 1
            continue
        try:
            _delete_file(file)
            report.files += 1
        except Exception:
            logger.exception("expiry: deleting file %s failed; the next sweep tries again", file.id)
    return report
