"""Webhook endpoints of a tenant, the events delivered to them and every attempt at each delivery.

An event becomes one delivery per subscribed endpoint; a delivery is tried until the receiver answers
2xx or the attempts run out (`portal.webhooks.services.delivery`), and each try is kept for people
to see why a receiver got nothing.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from portal.webhooks.destinations import url_redacted

EVENT_TYPES = (
    # OpenAI's batch events, for jobs that are OpenAI batches (`data.id` is the batch's id).
    "batch.completed",
    "batch.failed",
    "batch.cancelled",
    "batch.expired",
    # The same for native jobs (`data.id` is the job's id), and their progress while they run.
    "job.completed",
    "job.failed",
    "job.cancelled",
    "job.expired",
    "job.progress",
)


class WebhookEndpoint(models.Model):
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.CASCADE, related_name="webhook_endpoints")
    url = models.CharField(
        max_length=2000, help_text="Checked by `portal.webhooks.destinations`, not by URL syntax rules."
    )
    secret = models.CharField(
        max_length=100, help_text="Standard Webhooks signing secret (whsec_…); shown to the tenant once, at creation."
    )
    event_types = models.JSONField(default=list, help_text="The event types sent to this endpoint.")
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "webhook endpoint"

    def __str__(self) -> str:
        # Its path or query may carry the receiver's token: never shown whole where a name is.
        return f"{url_redacted(self.url)} ({self.tenant})"

    def wants(self, event_type: str) -> bool:
        return self.enabled and event_type in self.event_types


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class WebhookDelivery(models.Model):
    """One event for one endpoint. `next_attempt_at` is also the claim: a sender moves it past its own
    attempt's end before it sends, so a second message for the same delivery finds it not due."""

    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event_id = models.CharField(max_length=40, help_text="The event's id, sent as `webhook-id` on every attempt.")
    event_type = models.CharField(max_length=40)
    payload = models.JSONField(help_text="The event as sent: id, object, type, created_at, data.")
    status = models.CharField(max_length=20, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempt_count = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "webhook deliveries"
        constraints = [models.UniqueConstraint(fields=["endpoint", "event_id"], name="unique_event_per_endpoint")]
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="webhooks_delivery_due")]

    def __str__(self) -> str:
        return f"{self.event_type} {self.event_id} -> {self.endpoint_id} ({self.status})"


class WebhookAttempt(models.Model):
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField(default=0)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True, help_text="Empty: no HTTP answer.")
    error = models.TextField(blank=True, help_text="Why the attempt failed; empty when the receiver answered 2xx.")

    class Meta:
        ordering = ["delivery", "number"]

    def __str__(self) -> str:
        return f"attempt {self.number} of delivery {self.delivery_id}"
