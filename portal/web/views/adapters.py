"""LoRA adapters: the tenant's own and the shared ones it may use; members upload and delete their own.

An upload goes whole to `adapter_register`, which checks it against its base model before it stores
anything: a refused one is shown again with the service's message beside the field it names, and
nothing is kept.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from portal.catalog.adapter_files import AdapterRefused
from portal.catalog.adapters import (
    AdapterNotDeletable,
    adapter_base_models,
    adapter_delete,
    adapter_register,
    adapters_for_tenant,
)
from portal.jobs.quota import QuotaExceeded
from portal.tenancy.models import Membership
from portal.web.access import PortalAccess, acting_user, page, refused, tenant_view
from portal.web.forms import AdapterForm

# The form's fields a refusal may name; any other (the service's "files") is shown with the two files.
FORM_FIELDS = frozenset({"name", "version", "base_model", "description"})


def _page(request: HttpRequest, portal: PortalAccess, form: AdapterForm, *, status: int = 200) -> HttpResponse:
    context = {"form": form, "adapters": adapters_for_tenant(portal.tenant).order_by("name", "-created_at")}
    return page(request, portal, "web/adapters.html", context, status=status)


@tenant_view()
def adapters(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    return _page(request, portal, AdapterForm(base_models=adapter_base_models(portal.tenant)))


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def adapter_upload(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    """Register the uploaded adapter as the tenant's; a refusal shows the page again (400) naming the field."""
    form = AdapterForm(request.POST, request.FILES, base_models=adapter_base_models(portal.tenant))
    if form.is_valid():
        data = form.cleaned_data
        config, weights = data["adapter_config"], data["adapter_model"]
        try:
            adapter = adapter_register(
                tenant=portal.tenant,
                name=data["name"],
                base_model_name=data["base_model"],
                version=data["version"],
                description=data["description"],
                config=config,
                config_bytes=config.size,
                weights=weights,
                weights_bytes=weights.size,
            )
        except AdapterRefused as exc:
            form.add_error(exc.field if exc.field in FORM_FIELDS else None, exc.message)
        except QuotaExceeded as exc:
            form.add_error(None, exc.message)
        else:
            messages.success(
                request, f"Adapter {adapter} registered on {adapter.base_model.name}: jobs and records may name it."
            )
            return redirect("web:adapters")
    return _page(request, portal, form, status=400)


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def adapter_delete_view(request: HttpRequest, portal: PortalAccess, adapter_id: int) -> HttpResponse:
    """Delete one of the tenant's adapters; a shared one is the operators' to delete (409)."""
    adapter = get_object_or_404(adapters_for_tenant(portal.tenant), pk=adapter_id)
    try:
        adapter_delete(adapter, tenant=portal.tenant, actor=acting_user(request))
    except AdapterNotDeletable as exc:
        return refused(request, portal, f"{exc}.", status=409)
    messages.success(request, f"Adapter {adapter} deleted; jobs that ran it keep their outputs and usage.")
    return redirect("web:adapters")
