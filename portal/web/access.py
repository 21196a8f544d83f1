"""The one place that ties a portal request to a tenant and a role: the `tenant_view` decorator.

A signed-in user acts for one tenant at a time: the one chosen in the tenant switcher (kept in the
session), else the tenant they joined first, so that a tenant they join later (by accepting an
invitation) never becomes their default unless they pick it. Every portal view is wrapped by `tenant_view`,
which resolves that access with `access_for_user`, refuses a role below the view's (403, as the API
does), and hands the view a `PortalAccess`; views reach the tenant's objects only through it, so an
object of another tenant is simply not found (404).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, Concatenate

from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render, resolve_url

from portal.tenancy.access import NoTenantAccess, TenantAccess, access_for_user
from portal.tenancy.invitations import invitations_pending_for
from portal.tenancy.models import Membership, Tenant

SESSION_TENANT = "batchery.tenant"
"""Session key of the tenant the user chose in the switcher."""


@dataclass(frozen=True)
class PortalAccess:
    """What a portal request acts with: a tenant and a role there, and the user's other tenants."""

    access: TenantAccess
    tenants: tuple[str, ...]
    """Names of every tenant the user belongs to, for the switcher."""

    @property
    def tenant(self) -> Tenant:
        return self.access.tenant

    @property
    def role(self) -> str:
        return self.access.role

    def allows(self, role: str) -> bool:
        return self.access.allows(role)

    # Templates cannot pass arguments, so the checks they need are properties.
    @property
    def can_submit(self) -> bool:
        return self.allows(Membership.Role.MEMBER)

    @property
    def can_manage_adapters(self) -> bool:
        return self.allows(Membership.Role.MEMBER)

    @property
    def can_manage_keys(self) -> bool:
        return self.allows(Membership.Role.ADMIN)

    @property
    def can_manage_webhooks(self) -> bool:
        return self.allows(Membership.Role.ADMIN)


def acting_user(request: HttpRequest) -> User | None:
    """The signed-in user a write is recorded as done by (None for no user)."""
    return request.user if isinstance(request.user, User) else None


def user_tenant_names(user: Any) -> tuple[str, ...]:
    """The names of the user's tenants, sorted."""
    names = Membership.objects.filter(user_id=user.pk).values_list("tenant__name", flat=True)
    return tuple(sorted(names))


def first_tenant_name(user: Any) -> str | None:
    """The name of the tenant the user joined first (their default), or None if they have none."""
    first = Membership.objects.filter(user_id=user.pk).order_by("created_at", "pk").values_list("tenant__name")
    found = first.first()
    return found[0] if found else None


def portal_access(request: HttpRequest) -> PortalAccess:
    """The tenant and role of a signed-in user's request; raises `NoTenantAccess` if they have none."""
    tenants = user_tenant_names(request.user)
    chosen = request.session.get(SESSION_TENANT)
    if chosen not in tenants:
        # No choice yet, or the chosen tenant is no longer theirs: fall back to the one they joined first.
        chosen = first_tenant_name(request.user)
        if chosen is None:
            raise NoTenantAccess(
                "you are not a member of any tenant; ask a tenant's administrator to invite you, "
                "then accept the invitation under Invitations"
            )
        request.session[SESSION_TENANT] = chosen
    return PortalAccess(access=access_for_user(request.user, chosen), tenants=tenants)


def switch_tenant(request: HttpRequest, name: str) -> PortalAccess:
    """Make `name` the tenant the user acts for; raises `NoTenantAccess` if they are not a member."""
    access = access_for_user(request.user, name)
    request.session[SESSION_TENANT] = access.tenant.name
    return PortalAccess(access=access, tenants=user_tenant_names(request.user))


def page(
    request: HttpRequest, portal: PortalAccess | None, template: str, context: dict[str, Any], *, status: int = 200
) -> HttpResponse:
    """Render a portal template with what the layout needs (the tenant, the role, the switcher)."""
    return render(request, template, {"portal": portal, **context}, status=status)


def refused(request: HttpRequest, portal: PortalAccess | None, message: str, *, status: int) -> HttpResponse:
    """The portal's page for a refusal: 403 (role, no tenant), 404 (not the tenant's), 409 (not now); or 202
    for a result still being written (reload later)."""
    return page(request, portal, "web/refused.html", {"status": status, "message": message}, status=status)


PortalView = Callable[Concatenate[HttpRequest, PortalAccess, ...], HttpResponseBase]


def tenant_view(role: str = Membership.Role.VIEWER) -> Callable[[PortalView], Callable[..., HttpResponseBase]]:
    """Wrap a portal view: sign-in required, tenant resolved, `role` or above required.

    The view is called as `view(request, portal, *args, **kwargs)`. A `Http404` it raises becomes the
    portal's not-found page.
    """

    def decorate(view: PortalView) -> Callable[..., HttpResponseBase]:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not request.user.is_authenticated:
                if request.headers.get("HX-Request"):
                    # A poll after the session ended: send the whole page to sign-in, not the fragment.
                    response = HttpResponse(status=204)
                    response["HX-Redirect"] = resolve_url(settings.LOGIN_URL)
                    return response
                return redirect_to_login(request.get_full_path())
            try:
                portal = portal_access(request)
            except NoTenantAccess as exc:
                if invitations_pending_for(request.user).exists():
                    return redirect("web:invitations")
                return refused(request, None, str(exc), status=403)
            if not portal.allows(role):
                message = f"Your role in {portal.tenant.name} is {portal.role}; this needs {role} or above."
                return refused(request, portal, message, status=403)
            try:
                return view(request, portal, *args, **kwargs)
            except Http404:
                return refused(request, portal, f"There is no such page in {portal.tenant.name}.", status=404)

        return wrapper

    return decorate
