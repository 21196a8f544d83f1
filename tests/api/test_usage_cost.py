"""GET /api/v1/usage/ and /periods/: each ledger line's cost, and each month's in all and per model."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tests.factories import ModelFactory
from tests.support.ledger import ledger_line, price

pytestmark = pytest.mark.django_db

NOV_10 = dt.datetime(2026, 11, 10, 12, tzinfo=dt.UTC)
NOV_20 = dt.datetime(2026, 11, 20, 12, tzinfo=dt.UTC)


def test_the_usage_api_shows_each_line_s_cost_and_each_month_s_per_model(caller: Any, minilm: Any) -> None:
    alice = caller("acme")
    other = ModelFactory(name="other-embedder", is_default=False)
    price(minilm, per_gpu_second="0.5")
    price(other, per_gpu_second="0.25")
    ledger_line(alice.tenant, minilm, recorded_at=NOV_10, gpu_seconds=3)
    ledger_line(alice.tenant, other, recorded_at=NOV_20, gpu_seconds=3)
    lines = alice.client.get("/api/v1/usage/").json()["results"]
    assert [line["cost"] for line in lines] == [
        {"amount": "0.75", "currency": "USD"},
        {"amount": "1.50", "currency": "USD"},
    ]
    (month,) = alice.client.get("/api/v1/usage/periods/").json()
    assert month["cost"] == {"amount": "2.25", "currency": "USD"}
    assert month["models"] == [
        {"model": str(minilm), "cost": {"amount": "1.50", "currency": "USD"}},
        {"model": str(other), "cost": {"amount": "0.75", "currency": "USD"}},
    ]
