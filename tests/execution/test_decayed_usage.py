"""The fair-share ledger's charges: decayed usage plus the charge, never below zero, for many tenants at
once in one statement on PostgreSQL."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.execution.decayed_usage import usage_charge, usage_read
from portal.tenancy.models import FairShareUsage
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def test_charging_many_tenants_decays_each_adds_its_charge_and_clamps_at_zero(gpu_class: Any, settings: Any) -> None:
    settings.BATCHERY_FAIR_SHARE_HALF_LIFE_S = 60
    charged, corrected, new, refunded = (TenantFactory(name=name) for name in ("charged", "corrected", "new", "ref"))
    then = timezone.now() - dt.timedelta(seconds=120)
    usage_charge(charges={charged.pk: 40.0, corrected.pk: 40.0}, gpu_class_id=gpu_class.pk, now=then)
    now = then + dt.timedelta(seconds=120)

    with CaptureQueriesContext(connection) as captured:
        usage_charge(
            charges={charged.pk: 5.0, corrected.pk: -30.0, new.pk: 7.0, refunded.pk: -3.0},
            gpu_class_id=gpu_class.pk,
            now=now,
        )

    usage = {row.tenant_id: row.usage for row in FairShareUsage.objects.filter(gpu_class=gpu_class)}
    # 40 GPU-seconds two half-lives ago are 10 now.
    assert usage[charged.pk] == pytest.approx(15.0)
    assert usage[corrected.pk] == 0.0, "a correction larger than what is left leaves nothing, not a debt"
    assert usage[new.pk] == 7.0
    assert usage[refunded.pk] == 0.0, "a tenant's first line is never below zero"
    assert FairShareUsage.objects.get(tenant=charged, gpu_class=gpu_class).updated_at == now
    assert usage_read(tenant_ids=[charged.pk], gpu_class_id=gpu_class.pk, now=now)[charged.pk] == pytest.approx(15.0)
    if connection.vendor == "postgresql":
        assert len(captured.captured_queries) == 1, [query["sql"] for query in captured.captured_queries]


def test_a_charge_dated_before_the_row_adds_to_it_undecayed(gpu_class: Any) -> None:
    tenant = TenantFactory(name="late")
    now = timezone.now()
    usage_charge(charges={tenant.pk: 10.0}, gpu_class_id=gpu_class.pk, now=now)

    usage_charge(charges={tenant.pk: 2.0}, gpu_class_id=gpu_class.pk, now=now - dt.timedelta(seconds=30))

    assert FairShareUsage.objects.get(tenant=tenant).usage == 12.0
