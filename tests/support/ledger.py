"""Ledger lines and prices made by hand, for tests of what jobs cost."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from portal.catalog.models import Price
from portal.jobs.models import Job, JobStatus, JobUsage
from portal.jobs.usage import month_of


def price(
    model: Any,
    *,
    effective_from: dt.date = dt.date(2026, 1, 1),
    adapter: Any = None,
    gpu_class: Any = None,
    **amounts: str,
) -> Price:
    """A price of `model` in USD, validated as the admin validates it; amounts as decimal strings."""
    made = Price(
        model=model,
        adapter=adapter,
        gpu_class=gpu_class,
        currency="USD",
        effective_from=effective_from,
        **{name: Decimal(value) for name, value in amounts.items()},
    )
    made.full_clean()
    made.save()
    return made


def ledger_line(
    tenant: Any,
    model: Any,
    *,
    recorded_at: dt.datetime,
    gpu_seconds: float = 0.0,
    prompt: int = 0,
    cached: int = 0,
    completion: int = 0,
    records: int = 10,
) -> JobUsage:
    """A succeeded job and its ledger line, as `usage_record` writes it."""
    job = Job.objects.create(
        tenant=tenant, model=model, status=JobStatus.SUCCEEDED, input_uri="file:///x.jsonl", finished_at=recorded_at
    )
    return JobUsage.objects.create(
        job=job,
        tenant=tenant,
        model=model,
        period=month_of(recorded_at),
        status=JobStatus.SUCCEEDED,
        records_succeeded=records,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        completion_tokens=completion,
        gpu_seconds=gpu_seconds,
        recorded_at=recorded_at,
    )
