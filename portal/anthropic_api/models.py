"""Anthropic's message batches, each beside the Batchery job of task `chat` it runs as.

A batch's processing status, counts and timestamps are read from its job (`selectors.py`); the row holds
only what Anthropic has and Batchery does not: the batch's id, the key that created it (the only key that
sees it, see `views.py`), how many requests it holds, and when it expires.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class MessageBatch(models.Model):
    id = models.CharField(max_length=60, primary_key=True)
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.CASCADE, related_name="message_batches")
    api_key = models.ForeignKey(
        "tenancy.ApiKey",
        on_delete=models.CASCADE,
        related_name="message_batches",
        help_text="The key that created it: the only one that sees it.",
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    job = models.OneToOneField(
        "jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="message_batch"
    )
    request_count = models.PositiveIntegerField(help_text="Requests in the batch, one record each.")
    created_at = models.DateTimeField(db_index=True)
    expires_at = models.DateTimeField(help_text="24 hours after creation, as at Anthropic: the job's deadline.")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "message batch"
        verbose_name_plural = "message batches"

    def __str__(self) -> str:
        return self.id
