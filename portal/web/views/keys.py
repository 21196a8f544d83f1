"""API keys, for the tenant's admins: list, create (the key is shown once), revoke."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib import messages
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.tenancy.apikeys import apikey_create, apikey_revoke
from portal.tenancy.models import ApiKey, Membership
from portal.web.access import PortalAccess, acting_user, page, tenant_view
from portal.web.forms import ApiKeyForm


@tenant_view(role=Membership.Role.ADMIN)
def api_keys(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    form = ApiKeyForm(request.POST or None)
    created: dict[str, Any] | None = None
    if request.method == "POST" and form.is_valid():
        user = request.user
        assert isinstance(user, User)
        days = form.cleaned_data.get("expires_in_days")
        key, plaintext = apikey_create(
            tenant=portal.tenant,
            user=user,
            name=form.cleaned_data.get("name", ""),
            expires_at=timezone.now() + dt.timedelta(days=days) if days else None,
            actor=user,
        )
        created = {"key": key, "plaintext": plaintext}
        form = ApiKeyForm()
    keys = ApiKey.objects.filter(tenant=portal.tenant).select_related("user").order_by("-created_at")
    context = {"keys": keys, "form": form, "created": created, "now": timezone.now()}
    response = page(request, portal, "web/api_keys.html", context)
    # The page may hold a key in plain text: keep it out of every cache.
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@tenant_view(role=Membership.Role.ADMIN)
def api_key_revoke(request: HttpRequest, portal: PortalAccess, key_id: int) -> HttpResponse:
    key = get_object_or_404(ApiKey.objects.filter(tenant=portal.tenant), pk=key_id)
    if apikey_revoke(key=key, actor=acting_user(request)):
        messages.success(request, f"Key bk_{key.prefix}… revoked; requests made with it are refused from now on.")
    else:
        messages.info(request, f"Key bk_{key.prefix}… was already revoked.")
    return redirect("web:api-keys")
