"""The tenant's models, the fleet, usage against quota, and the tenant switcher."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from portal.catalog.selectors import models_for_tenant
from portal.ops.selectors import fleet_hosts_page, flower_link
from portal.tenancy.access import NoTenantAccess
from portal.web.access import PortalAccess, page, refused, switch_tenant, tenant_view
from portal.web.selectors import adapter_usage_by_month, fleet_view, quota_use, usage_by_month


@tenant_view()
def models(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    catalog = models_for_tenant(portal.tenant).order_by("name", "-version")
    return page(request, portal, "web/models.html", {"models": catalog})


def _fleet_context(request: HttpRequest, portal: PortalAccess) -> dict[str, Any]:
    fleet = fleet_view(portal.tenant)
    busy = sum(slot.busy for slot in fleet.slots)
    hosts = fleet_hosts_page(fleet.slots, host=lambda slot: slot.host, page=request.GET.get("page"))
    return {
        "slots": fleet.slots,
        "classes": fleet.classes,
        "hosts_page": hosts,
        "host_count": hosts.paginator.count,
        "busy": busy,
        "idle": len(fleet.slots) - busy,
    }


@tenant_view()
def fleet(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    context = {**_fleet_context(request, portal), "flower_url": flower_link(request.user)}
    return page(request, portal, "web/fleet.html", context)


@tenant_view()
def fleet_live(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    """The fleet's summary and a page of its hosts, polled by htmx."""
    return page(request, portal, "web/_fleet_live.html", _fleet_context(request, portal))


@tenant_view()
def usage(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    context = {
        "months": usage_by_month(portal.tenant),
        "adapter_months": adapter_usage_by_month(portal.tenant),
        "quota": quota_use(portal.tenant),
    }
    return page(request, portal, "web/usage.html", context)


@require_POST
@tenant_view()
def tenant_switch(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    """Act for another of the user's tenants from now on (kept in the session)."""
    try:
        switch_tenant(request, request.POST.get("tenant", ""))
    except NoTenantAccess as exc:
        return refused(request, portal, str(exc), status=403)
    # The page the user was on may be an object of the old tenant: start from the dashboard.
    return redirect("web:dashboard")
