"""Writes to tenants and memberships."""

from __future__ import annotations

from django.db import transaction

from portal.tenancy.models import Quota, Tenant


def tenant_create(*, name: str, priority: int = 5) -> Tenant:
    if not name.strip():
        raise ValueError("a tenant needs a name")
    with transaction.atomic():
        tenant = Tenant.objects.create(name=name.strip(), priority=priority)
        Quota.objects.create(tenant=tenant)
    return tenant


def tenant_get_or_create(*, name: str) -> Tenant:
    tenant = Tenant.objects.filter(name=name).first()
    return tenant if tenant is not None else tenant_create(name=name)
