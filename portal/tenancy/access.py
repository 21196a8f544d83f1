"""Who acts for which tenant, with which role: resolved once per request, used by every API view.

A request made with an API key acts for the key's tenant with its user's role there. A browser
session acts for one of the user's tenants: the one named by the `X-Batchery-Tenant` header, or the
only one the user belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

from portal.tenancy.models import ApiKey, Membership, Tenant

TENANT_HEADER = "X-Batchery-Tenant"


class NoTenantAccess(Exception):
    """The caller acts for no tenant (no membership, or an ambiguous choice); the message says why."""


@dataclass(frozen=True)
class TenantAccess:
    tenant: Tenant
    role: str

    def allows(self, role: str) -> bool:
        """True if this access's role is `role` or above it."""
        return Membership.RANKS[self.role] >= Membership.RANKS[role]


def access_for_key(key: ApiKey) -> TenantAccess | None:
    """The access an API key grants: its user's role in its tenant, or None if the user left it.

    A key from `apikey_authenticate` carries the role, read with it (``member_role``); another is looked up.
    """
    if hasattr(key, "member_role"):
        found = key.member_role
    else:
        role = Membership.objects.filter(user_id=key.user_id, tenant_id=key.tenant_id).values_list("role", flat=True)
        found = role.first()
    return TenantAccess(tenant=key.tenant, role=found) if found else None


def access_for_user(user: AbstractBaseUser | AnonymousUser, tenant_name: str | None) -> TenantAccess:
    """The access of a signed-in user: in the tenant named, or in the only tenant they belong to."""
    memberships = Membership.objects.select_related("tenant").filter(user_id=cast(int, user.pk))
    if tenant_name:
        membership = memberships.filter(tenant__name=tenant_name).first()
        if membership is None:
            raise NoTenantAccess(f"you are not a member of a tenant named {tenant_name!r}")
        return TenantAccess(tenant=membership.tenant, role=membership.role)
    found = list(memberships[:2])
    if not found:
        raise NoTenantAccess("you are not a member of any tenant")
    if len(found) > 1:
        raise NoTenantAccess(f"you belong to several tenants; name one in the {TENANT_HEADER} header")
    return TenantAccess(tenant=found[0].tenant, role=found[0].role)
