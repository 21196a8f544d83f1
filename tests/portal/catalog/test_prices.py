"""Prices in the catalog: what the admin accepts, and that a price in force is never rewritten."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.admin.sites import site
from django.core.exceptions import ValidationError
from django.utils import timezone

from portal.catalog.models import Adapter, Price
from tests.factories import ModelFactory
from tests.support.ledger import price

pytestmark = pytest.mark.django_db


def _errors(**fields: Any) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as caught:
        price(**fields)
    return caught.value.message_dict


def test_a_currency_must_be_an_iso_code_and_the_deployment_s_own(minilm: Any) -> None:
    made = Price(model=minilm, currency="usd", effective_from=dt.date(2026, 1, 1))
    with pytest.raises(ValidationError, match="not an ISO 4217 currency code"):
        made.full_clean()
    made.currency = "EUR"
    with pytest.raises(ValidationError, match="this deployment bills in USD"):
        made.full_clean()


def test_a_negative_price_is_refused(minilm: Any) -> None:
    assert _errors(model=minilm, per_million_output_tokens="-1") == {
        "per_million_output_tokens": ["A price cannot be negative."]
    }


def test_an_adapter_price_must_name_the_adapter_s_own_base_model(minilm: Any, acme: Any) -> None:
    other = ModelFactory(name="other-llm", is_default=False)
    adapter = Adapter.objects.create(name="alpha", base_model=other, owner=acme, source="/x", rank=4)
    errors = _errors(model=minilm, adapter=adapter, per_gpu_second="1")
    assert "is an adapter of other-llm@1" in errors["adapter"][0]


def test_the_admin_shows_a_bad_price_s_errors_beside_its_fields(admin_client: Any, minilm: Any) -> None:
    response = admin_client.post(
        "/admin/catalog/price/add/",
        {
            "model": minilm.pk,
            "currency": "usd",
            "per_gpu_second": "-0.5",
            "per_million_input_tokens": "0",
            "per_million_output_tokens": "0",
            "effective_from": "2026-11-01",
        },
    )
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "not an ISO 4217 currency code" in errors["currency"][0]
    assert errors["per_gpu_second"] == ["A price cannot be negative."]
    assert not Price.objects.exists()


def test_a_price_in_force_is_read_only_in_the_admin_and_one_to_come_is_not(admin_client: Any, minilm: Any) -> None:
    today = timezone.now().date()
    in_force = price(minilm, per_gpu_second="1", effective_from=today)
    to_come = price(minilm, per_gpu_second="2", effective_from=today + dt.timedelta(days=1))
    request = admin_client.get("/admin/").wsgi_request
    admin = site._registry[Price]
    assert not admin.has_change_permission(request, in_force) and not admin.has_delete_permission(request, in_force)
    assert admin.has_change_permission(request, to_come)
    response = admin_client.post(f"/admin/catalog/price/{in_force.pk}/change/", {"per_gpu_second": "9"})
    assert response.status_code in (302, 403)
    in_force.refresh_from_db()
    assert in_force.per_gpu_second == Decimal(1)


def test_two_prices_for_the_same_model_class_and_day_are_refused(minilm: Any) -> None:
    price(minilm, per_gpu_second="1", effective_from=dt.date(2026, 11, 1))
    price(minilm, gpu_class=minilm.gpu_class, per_gpu_second="2", effective_from=dt.date(2026, 11, 1))
    with pytest.raises(ValidationError, match="exists already"):
        price(minilm, per_gpu_second="3", effective_from=dt.date(2026, 11, 1))
