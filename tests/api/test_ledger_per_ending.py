"""Bills never change after the fact, retries included: each ending of a job (its first and each retry
round's) is a ledger line of its own, in the month it ended in, priced once when written; a redelivered
ending writes nothing."""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import call_command
from django.forms.models import model_to_dict
from django.utils import timezone

from portal.jobs.budget import budget_reached
from portal.jobs.models import Job, JobStatus, JobUsage, Shard, ShardStatus
from portal.jobs.signals import job_ending
from portal.jobs.transitions import job_transition
from portal.jobs.usage import usage_record
from portal.openai_api.selectors import _usage
from portal.tenancy.models import Quota
from tests.api.conftest import Caller
from tests.support.ledger import price

pytestmark = pytest.mark.django_db

NOV_20 = dt.datetime(2026, 11, 20, 12, tzinfo=dt.UTC)
DEC_3 = dt.datetime(2026, 12, 3, 12, tzinfo=dt.UTC)


def _chargeback(month: str) -> str:
    out = io.StringIO()
    call_command("chargeback", "--month", month, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def _shard(job: Job, *, index: int, round_: int, seconds: float, prompt: int, succeeded: int, failed: int) -> None:
    Shard.objects.create(
        job=job,
        index=index,
        round=round_,
        first_record=0,
        record_count=succeeded + failed,
        input_uri="file:///x",
        prefix_uri="file:///y",
        status=ShardStatus.SUCCEEDED,
        compute_seconds=seconds,
        load_seconds=0.0,
        prompt_tokens=prompt,
        completion_tokens=1,
        succeeded_records=succeeded,
        failed_records=failed,
    )


def _ended_in_november(tenant: Any, model: Any) -> Job:
    """A job of 10 records whose first round ended on November 20th with 4 of them failed."""
    job = Job.objects.create(
        tenant=tenant, model=model, status=JobStatus.MERGING, input_uri="file:///x.jsonl", total_records=10
    )
    _shard(job, index=0, round_=0, seconds=10.0, prompt=100, succeeded=6, failed=4)
    moved = job_transition(
        job_id=str(job.pk),
        source=JobStatus.MERGING,
        target=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=6,
        failed_records=4,
        finished_at=NOV_20,
    )
    assert moved
    return job


def _retried_in_december(job: Job) -> None:
    """Its retry round (the 4 failed records), as `job_retry` and the retry's planner and merge move it,
    ending on December 3rd with 3 of them succeeded."""
    pk = str(job.pk)
    job_transition(
        job_id=pk, source=JobStatus.PARTIALLY_SUCCEEDED, target=JobStatus.PLANNING, retry_round=1, finished_at=None
    )
    job_transition(job_id=pk, source=JobStatus.PLANNING, target=JobStatus.RUNNING)
    _shard(job, index=1, round_=1, seconds=2.0, prompt=40, succeeded=3, failed=1)
    job_transition(job_id=pk, source=JobStatus.RUNNING, target=JobStatus.MERGING)
    job_transition(
        job_id=pk,
        source=JobStatus.MERGING,
        target=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=9,
        failed_records=1,
        finished_at=DEC_3,
    )


def test_a_retry_in_a_later_month_adds_a_line_there_and_the_earlier_month_s_bill_stays_byte_identical(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    acme = caller("acme")
    price(minilm, effective_from=dt.date(2026, 1, 1), per_gpu_second="1")
    job = _ended_in_november(acme.tenant, minilm)
    (first,) = JobUsage.objects.filter(job=job)
    assert (first.round, first.period, first.cost) == (0, dt.date(2026, 11, 1), Decimal("10"))
    november_csv = _chargeback("2026-11")
    november = acme.client.get("/api/v1/usage/periods/?period=2026-11-01").content
    assert b'"amount":"10.00"' in november
    # The price doubles between the two endings: the first line keeps the price of its day.
    price(minilm, effective_from=dt.date(2026, 12, 1), per_gpu_second="2")

    _retried_in_december(job)

    assert _chargeback("2026-11") == november_csv
    assert acme.client.get("/api/v1/usage/periods/?period=2026-11-01").content == november
    assert model_to_dict(JobUsage.objects.get(pk=first.pk)) == model_to_dict(first)
    second = JobUsage.objects.get(job=job, round=1)
    # The round's own usage, priced at December's prices: its 2 GPU-seconds at 2 a second.
    assert (second.period, second.gpu_seconds, second.prompt_tokens, second.cost) == (
        dt.date(2026, 12, 1),
        2.0,
        40,
        Decimal("4"),
    )
    assert (second.records_succeeded, second.records_failed) == (3, 1), "the 4 records the round ran"
    december = list(csv.DictReader(io.StringIO(_chargeback("2026-12"))))
    assert [(row["jobs"], row["gpu_seconds"], row["cost"]) for row in december] == [("1", "2.000", "4.00")]
    lines = acme.client.get("/api/v1/usage/").json()["results"]
    assert [(line["round"], line["period"], line["cost"]["amount"]) for line in lines] == [
        (1, "2026-12-01", "4.00"),
        (0, "2026-11-01", "10.00"),
    ]


def test_a_job_s_figures_are_the_sums_of_its_lines(caller: Callable[..., Caller], minilm: Any) -> None:
    acme = caller("acme")
    price(minilm, per_gpu_second="1")
    job = _ended_in_november(acme.tenant, minilm)
    _retried_in_december(job)
    job.refresh_from_db()
    cost = acme.client.get(f"/api/v1/jobs/{job.pk}/cost/").json()
    assert cost == {"final": True, "cost": {"amount": "12.00", "currency": "USD"}}
    usage = _usage(job)
    assert usage is not None and (usage["input_tokens"], usage["output_tokens"]) == (140, 2)
    lines = JobUsage.objects.filter(job=job)
    assert sum(line.records_succeeded for line in lines) == job.succeeded_records == 9


def test_a_redelivered_ending_writes_nothing_and_adds_no_gpu_seconds(acme: Any, minilm: Any) -> None:
    price(minilm, per_gpu_second="1")
    added: list[float] = []

    def charged(*, gpu_seconds_added: float, **_: Any) -> None:
        added.append(gpu_seconds_added)

    job_ending.connect(charged, dispatch_uid="test-ledger-charged")
    try:
        job = _ended_in_november(acme, minilm)
        _retried_in_december(job)
        before = list(JobUsage.objects.filter(job=job).order_by("round").values())
        job.refresh_from_db()
        assert usage_record(job=job) == 0.0
    finally:
        job_ending.disconnect(dispatch_uid="test-ledger-charged")
    assert added == [10.0, 2.0], "each ending charges its own round's GPU-seconds"
    assert list(JobUsage.objects.filter(job=job).order_by("round").values()) == before
    assert not job_transition(
        job_id=str(job.pk), source=JobStatus.MERGING, target=JobStatus.SUCCEEDED, finished_at=DEC_3
    )


def _retry_running(job: Job, *, seconds: float) -> None:
    """The job's retry round running, one of its shards settled after `seconds` GPU-seconds."""
    pk = str(job.pk)
    job_transition(
        job_id=pk, source=JobStatus.PARTIALLY_SUCCEEDED, target=JobStatus.PLANNING, retry_round=1, finished_at=None
    )
    job_transition(job_id=pk, source=JobStatus.PLANNING, target=JobStatus.RUNNING)
    _shard(job, index=1, round_=1, seconds=seconds, prompt=1, succeeded=2, failed=0)
    job.refresh_from_db()


@pytest.mark.parametrize(
    ("first_ended", "reached"),
    [(NOV_20, False), (None, True)],
    ids=["first-round-last-month", "first-round-this-month"],
)
def test_a_retry_s_budget_counts_its_earlier_rounds_only_in_the_month_they_ended(
    acme: Any, minilm: Any, first_ended: dt.datetime | None, reached: bool
) -> None:
    price(minilm, per_gpu_second="1")
    Quota.objects.filter(tenant=acme).update(monthly_budget=Decimal(15))
    job = _ended_in_november(acme, minilm)  # 10 GPU-seconds
    if first_ended is None:
        JobUsage.objects.filter(job=job).update(period=timezone.now().date().replace(day=1))
    _retry_running(job, seconds=8.0)
    # 8 of this round against 15: within it; with the first round's 10 spent this month too, past it.
    assert (budget_reached(job) is not None) == reached


def test_each_line_splits_its_own_round_s_usage_by_adapter(acme: Any, minilm: Any) -> None:
    job = Job.objects.create(
        tenant=acme,
        model=minilm,
        status=JobStatus.MERGING,
        input_uri="file:///x.jsonl",
        adapters={"bot": {"id": 999_999, "spec": {"name": "bot", "version": 1}}},
    )
    _shard(job, index=0, round_=0, seconds=1.0, prompt=60, succeeded=6, failed=4)
    Shard.objects.filter(job=job, round=0).update(adapter_usage={"bot@1": [6, 4, 60, 6]})
    job_transition(
        job_id=str(job.pk),
        source=JobStatus.MERGING,
        target=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=6,
        failed_records=4,
        finished_at=NOV_20,
    )
    _retry_running(job, seconds=1.0)
    Shard.objects.filter(job=job, round=1).update(adapter_usage={"bot@1": [3, 1, 40, 4]})
    job_transition(job_id=str(job.pk), source=JobStatus.RUNNING, target=JobStatus.MERGING)
    job_transition(
        job_id=str(job.pk),
        source=JobStatus.MERGING,
        target=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=9,
        failed_records=1,
        finished_at=DEC_3,
    )
    splits = [
        (line.round, [(s.name, s.records_succeeded, s.records_failed, s.prompt_tokens) for s in line.adapters.all()])
        for line in JobUsage.objects.filter(job=job).order_by("round")
    ]
    assert splits == [(0, [("bot@1", 6, 4, 60)]), (1, [("bot@1", 3, 1, 40)])]
