"""One line of the audit log: who did what to which object, for which tenant, and what changed."""

from __future__ import annotations

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


class AuditEntry(models.Model):
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_entries"
    )
    # Kept apart from the foreign key so the entry still names its actor once the user is deleted.
    actor_label = models.CharField(max_length=200, help_text='A username, or "system" for no signed-in user.')
    tenant = models.ForeignKey(
        "tenancy.Tenant", null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_entries"
    )
    action = models.CharField(max_length=50, db_index=True, help_text='What was done, e.g. "quota.changed".')
    target_type = models.CharField(max_length=100, help_text='The kind of object, e.g. "jobs.job" or "slot".')
    target_id = models.CharField(max_length=200)
    summary = models.TextField(blank=True)
    changes = models.JSONField(
        default=dict, blank=True, encoder=DjangoJSONEncoder, help_text="Field name to [old value, new value]."
    )

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["tenant", "at"])]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.actor_label}: {self.action} {self.target_type} {self.target_id}"
