"""OpenAI's Batch API objects, kept beside the Batchery job each batch runs as.

A batch's status, counts and timestamps are read from its job; the batch row holds only what OpenAI
has and Batchery does not: the endpoint, the window, the metadata, the validation errors and the
output files in OpenAI's line format. A batch without a job, errors or an ending is still `validating`
(a large input file is checked by a control task, `portal/openai_api/services/validation.py`).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class FileQuerySet(models.QuerySet["File"]):
    def unexpired(self) -> FileQuerySet:
        """Files not past their `expires_at`: an expired file is gone for the API before the sweep deletes it."""
        return self.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))


class File(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(max_length=40, primary_key=True)
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    uri = models.CharField(max_length=1000)
    # Not `auto_now_add`: `expires_at` is counted from this moment, so the service sets both at once.
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    expires_at = models.DateTimeField(
        null=True, blank=True, db_index=True, help_text="Past it the sweep deletes the file; empty: kept until deleted."
    )

    objects = FileQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    id = models.CharField(max_length=40, primary_key=True)
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.CASCADE, related_name="batches")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    endpoint = models.CharField(max_length=50)
    completion_window = models.CharField(max_length=10)
    metadata = models.JSONField(null=True, blank=True)
    input_file_id = models.CharField(max_length=40, help_text="Kept if the file is deleted later, as OpenAI does.")
    job = models.OneToOneField("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="batch")
    validation_errors = models.JSONField(
        null=True, blank=True, help_text="OpenAI's `errors` object when the input was refused; the batch failed."
    )
    output_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    finalized_at = models.DateTimeField(null=True, blank=True, help_text="When the output files were written.")
    cancelled_at = models.DateTimeField(
        null=True, blank=True, help_text="When it was cancelled while validating, before it had a job."
    )
    output_expires_after_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The output and error files expire this long after they are written; empty: kept until deleted.",
    )

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return self.id
