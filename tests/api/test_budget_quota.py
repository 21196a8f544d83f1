"""The monthly budget quota: the dry run's cost bounds, and a job whose hold passes what is left
of the tenant's budget refused at submission with 429, as every quota refuses."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import BudgetHold, Quota
from tests.api.conftest import Caller
from tests.support.ledger import ledger_line, price

pytestmark = pytest.mark.django_db

RECORDS = [{"custom_id": f"r{n}", "input": f"sentence number {n}"} for n in range(12)]
PER_TOKEN = "3000000"
"""Per million input tokens: 3 a token, so that a dozen short records cost whole units."""


def _submit(alice: Caller, path: Path, **fields: Any) -> Any:
    with path.open("rb") as handle:
        return alice.client.post(
            "/api/v1/jobs/", {"file": handle, "model": "all-MiniLM-L6-v2", **fields}, format="multipart"
        )


def _dry_run(alice: Caller, path: Path) -> dict[str, Any]:
    response = _submit(alice, path, dry_run="true")
    assert response.status_code == 200, response.content
    return dict(response.json())


def test_the_dry_run_reports_cost_bounds_at_today_s_prices(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    path = write_jsonl(RECORDS)
    assert _dry_run(alice, path)["cost"] == {
        "low": "0.00",
        "high": "0.00",
        "currency": "USD",
        "priced": False,
        "hold": "0.00",
    }
    price(minilm, per_gpu_second="0.01", per_million_input_tokens=PER_TOKEN, effective_from=timezone.now().date())
    report = _dry_run(alice, path)
    tokens = report["estimated_input_tokens"]
    low, high = Decimal(report["cost"]["low"]), Decimal(report["cost"]["high"])
    # BATCHERY_COST_ESTIMATE_FACTOR, 3, either way of the tokens (at 3 each) and of the GPU-seconds.
    assert tokens > 0 and tokens <= low < tokens * 3 < tokens * 9 <= high
    # The budget's hold: every token and second at its price, neither discounted nor inflated.
    assert tokens * 3 <= Decimal(report["cost"]["hold"]) < tokens * 3 + 1
    assert report["cost"]["priced"] and report["budget"] is None and report["accepted"]


def test_a_job_whose_hold_passes_the_budget_left_is_refused_with_429_naming_budget_spend_and_hold(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    path = write_jsonl(RECORDS)
    price(minilm, per_million_input_tokens=PER_TOKEN, effective_from=timezone.now().date())
    low = Decimal(_dry_run(alice, path)["cost"]["hold"])
    # Spent this month: a job that ended, at 3 a token.
    ledger_line(alice.tenant, minilm, recorded_at=timezone.now(), prompt=10)
    Quota.objects.filter(tenant=alice.tenant).update(monthly_budget=Decimal(30) + low - Decimal("0.01"))
    report = _dry_run(alice, path)
    assert report["budget"]["refused"] and not report["accepted"]
    response = _submit(alice, path)
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert error["code"] == "quota_exceeded" and error["param"] == "monthly_budget"
    assert error["quota"] == {
        "name": "monthly_budget",
        "limit": str(Decimal(30) + low - Decimal("0.01")),
        "current": "30.00",
        "requested": str(low),
    }
    assert "budget" in error["message"] and f"this job holds {low}" in error["message"]
    assert Job.objects.count() == 1  # the one that ended


def test_a_job_within_the_budget_holds_its_cost_so_the_next_one_counts_it(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    path = write_jsonl(RECORDS)
    price(minilm, per_million_input_tokens=PER_TOKEN, effective_from=timezone.now().date())
    low = Decimal(_dry_run(alice, path)["cost"]["hold"])
    Quota.objects.filter(tenant=alice.tenant).update(monthly_budget=low * 2 - Decimal("0.01"))
    first = _submit(alice, path)
    assert first.status_code == 201, first.content
    assert BudgetHold.objects.get(job_id=first.json()["id"]).amount == low
    # The same service answers the CLI, the portal form and the OpenAI and Anthropic batches.
    with pytest.raises(QuotaExceeded) as refused:
        job_submit(tenant=alice.tenant, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert refused.value.quota == "monthly_budget" and refused.value.current == f"{low:.2f}"
    assert Job.objects.count() == 1


def test_the_hold_counts_each_record_s_own_output_cap_as_an_openai_batch_line_sets_it(
    caller: Callable[..., Caller], tiny_chat: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    price(tiny_chat, per_million_output_tokens="1000000", effective_from=timezone.now().date())
    messages = [{"role": "user", "content": "hi"}]
    plain = write_jsonl([{"custom_id": f"r{n}", "messages": messages} for n in range(12)], "plain.jsonl")
    own = write_jsonl(
        [{"custom_id": f"r{n}", "messages": messages, "params": {"max_tokens": 1000, "n": 2}} for n in range(12)],
        "own.jsonl",
    )

    def hold(path: Path) -> Decimal:
        with path.open("rb") as handle:
            answer = alice.client.post(
                "/api/v1/jobs/",
                {"file": handle, "model": "tiny-chat", "params": '{"max_tokens": 10}', "dry_run": "true"},
                format="multipart",
            )
        assert answer.status_code == 200, answer.content
        return Decimal(answer.json()["cost"]["hold"])

    # One unit a generated token: the job's cap, 10 a record; each record's own, 1,000 twice.
    assert hold(plain) == 12 * 10
    assert hold(own) == 12 * 1000 * 2
