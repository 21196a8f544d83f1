"""The portal's costs: a job's page (so far while it runs), the usage page per month and model, the dry run."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from portal.tenancy.models import Quota, Tenant
from tests.support.ledger import ledger_line, price

pytestmark = pytest.mark.django_db


def _client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_usage_page_shows_each_month_s_cost_in_all_and_per_model(
    person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    price(minilm, per_gpu_second="0.5")
    ledger_line(acme, minilm, recorded_at=dt.datetime(2026, 11, 10, tzinfo=dt.UTC), gpu_seconds=5)
    ledger = ledger_line(acme, minilm, recorded_at=dt.datetime(2026, 11, 11, tzinfo=dt.UTC), gpu_seconds=1)
    client = _client(person("alice", acme))
    html = client.get("/usage/").content.decode()
    assert "3.00 USD" in html and 'id="usage-model-costs"' in html
    assert "0.50 USD" in client.get(f"/jobs/{ledger.job_id}/").content.decode()
    assert "Budget this month" not in html
    Quota.objects.filter(tenant=acme).update(monthly_budget=50)
    assert "Budget this month (USD)" in client.get("/usage/").content.decode()


def test_check_first_shows_the_cost_bounds(
    person: Callable[..., User], acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    price(minilm, per_million_input_tokens="1000000", effective_from=timezone.now().date())
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(5)])
    with path.open("rb") as handle:
        response = _client(person("alice", acme)).post(
            "/jobs/new/",
            {
                "file": handle,
                "input_format": "auto",
                "output_format": "jsonl",
                "model": str(minilm.pk),
                "action": "check",
            },
        )
    report = response.context["report"]
    assert f"{report.cost.low} \u2013 {report.cost.high} USD" in response.content.decode()
