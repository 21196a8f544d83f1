"""Roles: viewers read; members submit and cancel; admins manage keys and members.

A view names the role each action needs in `required_roles`; reads need `viewer`, other methods
`member`, unless it says otherwise.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from portal.api.access import request_access
from portal.tenancy.models import Membership


def required_role(request: Request, view: Any) -> str:
    roles: dict[str, str] = getattr(view, "required_roles", {})
    action = getattr(view, "action", None) or (request.method or "").lower()
    if action in roles:
        return roles[action]
    if "*" in roles:
        return roles["*"]
    return Membership.Role.VIEWER if request.method in SAFE_METHODS else Membership.Role.MEMBER


class TenantRolePermission(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        if request.user is None or not request.user.is_authenticated:
            return False
        access = request_access(request)
        needed = required_role(request, view)
        if not access.allows(needed):
            raise PermissionDenied(f"your role in {access.tenant.name} is {access.role}; this needs {needed} or above")
        return True
