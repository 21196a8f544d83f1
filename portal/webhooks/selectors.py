"""Reads of webhooks that the API and the portal share: a tenant's endpoints and recent deliveries."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from portal.tenancy.models import Tenant
from portal.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint


def webhook_endpoints(*, tenant: Tenant) -> QuerySet[WebhookEndpoint]:
    return WebhookEndpoint.objects.filter(tenant=tenant).order_by("-created_at")


def webhook_deliveries(*, tenant: Tenant, endpoint: WebhookEndpoint | None = None) -> QuerySet[WebhookDelivery]:
    """Deliveries newest first, each with its endpoint and its attempts in order."""
    deliveries = WebhookDelivery.objects.filter(endpoint__tenant=tenant)
    if endpoint is not None:
        deliveries = deliveries.filter(endpoint=endpoint)
    attempts = Prefetch("attempts", queryset=WebhookAttempt.objects.order_by("number"))
    return deliveries.select_related("endpoint").prefetch_related(attempts).order_by("-created_at")
