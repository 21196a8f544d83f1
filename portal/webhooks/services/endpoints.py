"""A tenant's webhook endpoints: registered (the URL checked, a signing secret made), enabled, removed."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from portal.audit.services import audit_record
from portal.tenancy.models import Tenant
from portal.webhooks.destinations import DestinationRefused, DestinationUnresolved, destination_check, url_redacted
from portal.webhooks.models import EVENT_TYPES, WebhookEndpoint

MAX_URL_CHARS = 2000
# Standard Webhooks: a secret of 24 to 64 random bytes, base64 after `whsec_`.
SECRET_BYTES = 32


class WebhookRefused(Exception):
    """The endpoint cannot be registered; `field` names the input at fault."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def _new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def webhook_endpoint_create(
    *, tenant: Tenant, url: str, event_types: Sequence[str] | None = None, actor: User | None = None
) -> WebhookEndpoint:
    """Register an endpoint for `event_types` (all of them when None); its secret is on the returned
    object, to be shown this once. Raises `WebhookRefused` for an unknown event type, a URL that
    may not be delivered to (see `portal.webhooks.destinations`), or a tenant that has as many
    endpoints as `BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT` allows."""
    url = url.strip()
    chosen = list(EVENT_TYPES) if event_types is None else list(dict.fromkeys(event_types))
    unknown = [name for name in chosen if name not in EVENT_TYPES]
    if unknown:
        raise WebhookRefused(f"unknown event type {unknown[0]!r}; known: {', '.join(EVENT_TYPES)}", field="event_types")
    if not chosen:
        raise WebhookRefused("name at least one event type", field="event_types")
    if len(url) > MAX_URL_CHARS:
        raise WebhookRefused(f"the URL is longer than {MAX_URL_CHARS} characters", field="url")
    try:
        # Within a web request: a slow name server is answered, not waited on.
        destination_check(
            url,
            allowed_hosts=settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS,
            resolve_timeout_s=settings.BATCHERY_WEBHOOK_RESOLVE_TIMEOUT_S,
        )
    except (DestinationRefused, DestinationUnresolved) as exc:
        raise WebhookRefused(str(exc), field="url") from None
    with transaction.atomic():
        # The tenant's row locked: two registrations at once cannot both take the last place.
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        limit = settings.BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT
        if WebhookEndpoint.objects.filter(tenant=tenant).count() >= limit:
            raise WebhookRefused(
                f"this tenant has {limit} webhook endpoints, the most it may have "
                f"(BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT={limit}); remove one first",
                field="url",
            )
        endpoint = WebhookEndpoint.objects.create(
            tenant=tenant, url=url, secret=_new_secret(), event_types=chosen, created_by=actor
        )
        audit_record(
            actor=actor,
            action="webhook.created",
            target=endpoint,
            tenant=tenant,
            summary=f"webhook endpoint {url_redacted(url)} registered for {', '.join(chosen)}",
        )
    return endpoint


def webhook_endpoint_set_enabled(*, endpoint: WebhookEndpoint, enabled: bool, actor: User | None = None) -> bool:
    """Turn an endpoint's deliveries on or off; True if this call changed it."""
    with transaction.atomic():
        changed = WebhookEndpoint.objects.filter(pk=endpoint.pk, enabled=not enabled).update(enabled=enabled)
        if changed:
            audit_record(
                actor=actor,
                action="webhook.enabled" if enabled else "webhook.disabled",
                target=endpoint,
                tenant=endpoint.tenant,
                summary=f"webhook endpoint {url_redacted(endpoint.url)} {'enabled' if enabled else 'disabled'}",
                changes={"enabled": [not enabled, enabled]},
            )
    endpoint.enabled = enabled
    return bool(changed)


def webhook_endpoint_delete(*, endpoint: WebhookEndpoint, actor: User | None = None) -> None:
    """Remove an endpoint with its deliveries; those not yet sent are dropped."""
    with transaction.atomic():
        audit_record(
            actor=actor,
            action="webhook.deleted",
            target=endpoint,
            tenant=endpoint.tenant,
            summary=f"webhook endpoint {url_redacted(endpoint.url)} removed",
        )
        endpoint.delete()
