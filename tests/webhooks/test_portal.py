"""The portal's webhooks page: admins add an endpoint (its secret shown once), see deliveries with their
attempts, and remove it; a refused URL is shown on its field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from portal.audit.models import AuditEntry
from portal.tenancy.models import Membership, Tenant
from portal.webhooks.models import WebhookEndpoint
from portal.webhooks.services.delivery import webhook_deliver
from portal.webhooks.services.events import webhook_event_emit
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.webhooks.conftest import Receiver, endpoint_for

pytestmark = pytest.mark.django_db


def _signed_in(tenant: Tenant, role: str) -> Client:
    user = UserFactory(username=f"{tenant.name}-{role}")
    MembershipFactory(user=user, tenant=tenant, role=role)
    client = Client()
    client.force_login(user)
    return client


def test_an_admin_adds_sees_and_removes_an_endpoint(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver(500)
    admin = _signed_in(acme, Membership.Role.ADMIN)
    assert b'href="/webhooks/"' in admin.get("/").content

    created = admin.post("/webhooks/", {"url": server.url, "event_types": ["job.completed", "job.failed"]})
    assert created.status_code == 200 and created["Cache-Control"] == "no-store"
    endpoint = WebhookEndpoint.objects.get(tenant=acme)
    assert endpoint.event_types == ["job.completed", "job.failed"]
    assert endpoint.secret.encode() in created.content
    [delivery] = webhook_event_emit(tenant_id=acme.pk, event_type="job.failed", data={"id": "job-7"})
    webhook_deliver(delivery_id=delivery.pk)

    page = admin.get("/webhooks/")
    assert endpoint.secret.encode() not in page.content, "the secret is shown once"
    assert server.url.encode() in page.content and delivery.event_id.encode() in page.content
    assert b"#1" in page.content and b"the receiver answered 500" in page.content

    other = endpoint_for(TenantFactory(name="globex"), server.url)
    assert admin.post(f"/webhooks/{other.pk}/delete/").status_code == 404
    assert admin.post(f"/webhooks/{endpoint.pk}/delete/").status_code == 302
    assert not WebhookEndpoint.objects.filter(tenant=acme).exists()


def test_a_refused_url_is_shown_on_its_field_and_members_may_not_manage_webhooks(acme: Tenant, settings: Any) -> None:
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = []
    admin = _signed_in(acme, Membership.Role.ADMIN)
    refused = admin.post("/webhooks/", {"url": "http://169.254.169.254/", "event_types": ["batch.completed"]})
    assert refused.status_code == 200
    assert "a link-local address" in refused.context["form"].errors["url"][0]
    assert not WebhookEndpoint.objects.exists()
    assert _signed_in(acme, Membership.Role.MEMBER).get("/webhooks/").status_code == 403


def test_operators_see_endpoints_and_deliveries_in_the_admin_and_disable_through_the_service(
    acme: Tenant, admin_client: Client
) -> None:
    endpoint = endpoint_for(acme, "https://93.184.215.14/hook")
    [delivery] = webhook_event_emit(tenant_id=acme.pk, event_type="job.completed", data={"id": "job-1"})
    listing = admin_client.get("/admin/webhooks/webhookendpoint/")
    assert listing.status_code == 200 and endpoint.secret.encode() not in listing.content
    assert (
        endpoint.secret.encode()
        not in admin_client.get(f"/admin/webhooks/webhookendpoint/{endpoint.pk}/change/").content
    )
    assert admin_client.get(f"/admin/webhooks/webhookdelivery/{delivery.pk}/change/").status_code == 200

    admin_client.post("/admin/webhooks/webhookendpoint/", {"action": "disable", "_selected_action": [str(endpoint.pk)]})
    endpoint.refresh_from_db()
    assert not endpoint.enabled
    assert AuditEntry.objects.filter(action="webhook.disabled", target_id=str(endpoint.pk)).exists()
