"""Webhooks, for the tenant's admins: endpoints (add, with the secret shown once; remove) and the
recent deliveries with each attempt."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from portal.tenancy.models import Membership
from portal.web.access import PortalAccess, acting_user, page, tenant_view
from portal.web.forms import WebhookEndpointForm
from portal.webhooks.destinations import url_redacted
from portal.webhooks.models import EVENT_TYPES, WebhookEndpoint
from portal.webhooks.selectors import webhook_deliveries, webhook_endpoints
from portal.webhooks.services.endpoints import WebhookRefused, webhook_endpoint_create, webhook_endpoint_delete

RECENT_DELIVERIES = 50


@tenant_view(role=Membership.Role.ADMIN)
def webhooks(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    form = WebhookEndpointForm(request.POST or None)
    created: WebhookEndpoint | None = None
    if request.method == "POST" and form.is_valid():
        chosen = form.cleaned_data["event_types"]
        try:
            created = webhook_endpoint_create(
                tenant=portal.tenant,
                url=form.cleaned_data["url"],
                event_types=[name for name in EVENT_TYPES if name in chosen],
                actor=acting_user(request),
            )
        except WebhookRefused as exc:
            form.add_error(exc.field, exc.message)
        else:
            form = WebhookEndpointForm()
    context = {
        "form": form,
        "created": created,
        "endpoints": webhook_endpoints(tenant=portal.tenant),
        "deliveries": webhook_deliveries(tenant=portal.tenant)[:RECENT_DELIVERIES],
    }
    response = page(request, portal, "web/webhooks.html", context)
    # The page may hold a signing secret: keep it out of every cache.
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@tenant_view(role=Membership.Role.ADMIN)
def webhook_delete(request: HttpRequest, portal: PortalAccess, endpoint_id: int) -> HttpResponse:
    endpoint = get_object_or_404(webhook_endpoints(tenant=portal.tenant), pk=endpoint_id)
    webhook_endpoint_delete(endpoint=endpoint, actor=acting_user(request))
    messages.success(request, f"Endpoint {url_redacted(endpoint.url)} removed; it gets no more events.")
    return redirect("web:webhooks")
