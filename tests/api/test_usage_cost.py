"""GET /api/v1/usage/ and /periods/: each ledger line's cost, and each month's in all and per model."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
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


def test_a_job_s_cost_is_its_ended_shards_while_it_runs_and_its_ledger_line_s_once_it_ends(
    caller: Any, minilm: Any
) -> None:
    alice = caller("acme")
    price(minilm, per_gpu_second="0.5", per_million_input_tokens="1000000")
    job = Job.objects.create(tenant=alice.tenant, model=minilm, status=JobStatus.RUNNING, input_uri="file:///x")
    for index, status in enumerate((ShardStatus.SUCCEEDED, ShardStatus.DISPATCHED)):
        Shard.objects.create(
            job=job,
            index=index,
            first_record=index * 10,
            record_count=10,
            input_uri="x",
            prefix_uri="y",
            status=status,
            compute_seconds=4.0,
            prompt_tokens=3,
        )
    # The settled shard alone: 4 s at 0.5 and 3 tokens at 1 each.
    assert alice.client.get(f"/api/v1/jobs/{job.pk}/cost/").json() == {
        "final": False,
        "cost": {"amount": "5.00", "currency": "USD"},
    }
    ended = ledger_line(alice.tenant, minilm, recorded_at=NOV_10, gpu_seconds=10, prompt=1)
    assert alice.client.get(f"/api/v1/jobs/{ended.job_id}/cost/").json() == {
        "final": True,
        "cost": {"amount": "6.00", "currency": "USD"},
    }
