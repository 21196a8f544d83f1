"""The tenant and role a request acts with, resolved once and kept on the request."""

from __future__ import annotations

from django.contrib.auth.models import User
from rest_framework.exceptions import NotAuthenticated, PermissionDenied
from rest_framework.request import Request

from portal.api.authentication import ACCESS_ATTRIBUTE
from portal.tenancy.access import TENANT_HEADER, NoTenantAccess, TenantAccess, access_for_user


def request_access(request: Request) -> TenantAccess:
    """The tenant and role the request acts with (resolved once, then kept on the request)."""
    access: TenantAccess | None = getattr(request, ACCESS_ATTRIBUTE, None)
    if access is not None:
        return access
    user = request.user
    if user is None or not user.is_authenticated:
        raise NotAuthenticated()
    try:
        access = access_for_user(user, request.headers.get(TENANT_HEADER))
    except NoTenantAccess as exc:
        raise PermissionDenied(str(exc)) from None
    setattr(request, ACCESS_ATTRIBUTE, access)
    return access


def request_user(request: Request) -> User | None:
    """The signed-in user behind the request (the key's user for an API key)."""
    return request.user if isinstance(request.user, User) else None
