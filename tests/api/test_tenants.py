"""/api/v1/tenants/: operators set tenants' fair-share weights; tenants' own members cannot."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from portal.audit.models import AuditEntry
from portal.tenancy.models import FairShareUsage, Membership, Tenant
from tests.api.conftest import Caller
from tests.factories import GpuClassFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> APIClient:
    client = APIClient()
    client.force_login(UserFactory(username="ops", is_staff=True))
    return client


def test_an_operator_sets_a_weight_and_the_change_is_audited(operator: APIClient) -> None:
    tenant = TenantFactory(name="research")
    FairShareUsage.objects.create(
        tenant=tenant, gpu_class=GpuClassFactory(name="cpu"), usage=120.0, updated_at=timezone.now()
    )

    listed = operator.get("/api/v1/tenants/")
    changed = operator.patch(f"/api/v1/tenants/{tenant.pk}/", {"weight": 3}, format="json")

    assert listed.status_code == 200
    row = next(t for t in listed.json()["results"] if t["name"] == "research")
    assert row["weight"] == 1.0
    assert row["recent_gpu_seconds"]["cpu"] == pytest.approx(120.0, rel=0.01)
    assert changed.status_code == 200, changed.json()
    assert changed.json()["weight"] == 3.0
    assert Tenant.objects.get(pk=tenant.pk).weight == 3.0
    entry = AuditEntry.objects.get(action="tenant.changed", tenant=tenant)
    assert entry.actor_label == "ops"
    assert entry.changes == {"weight": [1.0, 3.0]}


@pytest.mark.parametrize(
    ("body", "field"), [({"weight": 0}, "weight"), ({"weight": "heavy"}, "weight"), ({"priority": 12}, "priority")]
)
def test_a_weight_or_priority_out_of_range_is_a_400_naming_the_field(
    operator: APIClient, body: dict[str, object], field: str
) -> None:
    tenant = TenantFactory(name="research")

    response = operator.patch(f"/api/v1/tenants/{tenant.pk}/", body, format="json")

    assert response.status_code == 400
    assert field in response.content.decode()
    assert Tenant.objects.get(pk=tenant.pk).weight == 1.0


def test_a_tenants_own_admin_may_not_change_its_weight(caller: Callable[..., Caller]) -> None:
    owner = caller("acme", Membership.Role.OWNER)

    assert owner.client.get("/api/v1/tenants/").status_code == 403
    assert owner.client.patch(f"/api/v1/tenants/{owner.tenant.pk}/", {"weight": 100}, format="json").status_code == 403
    assert Tenant.objects.get(pk=owner.tenant.pk).weight == 1.0
