"""The usage ledger: written when a job ends, GPU-seconds from shard timings; the monthly GPU quota."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.chargeback import chargeback_rows
from portal.jobs.models import Job, JobStatus, JobUsage, Shard, ShardStatus
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import JobRequest
from portal.jobs.selectors import usage_per_month
from portal.jobs.services.submit import job_submit
from portal.jobs.transitions import job_transition
from portal.jobs.usage import month_of
from portal.tenancy.models import Quota

pytestmark = pytest.mark.django_db


def _job_with_shards(tenant: Any, model: Any, timings: list[tuple[float, float, int, int]]) -> Job:
    job = Job.objects.create(
        tenant=tenant, model=model, status=JobStatus.MERGING, input_uri="file:///x.jsonl", shard_size=10
    )
    for index, (load, compute, prompt, completion) in enumerate(timings):
        Shard.objects.create(
            job=job,
            index=index,
            first_record=index * 10,
            record_count=10,
            input_uri="file:///x",
            prefix_uri="file:///y",
            status=ShardStatus.SUCCEEDED,
            load_seconds=load,
            compute_seconds=compute,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
    return job


def test_a_job_that_ends_gets_a_ledger_line_with_gpu_seconds_from_its_shards(acme: Any, minilm: Any) -> None:
    minilm.gpus_per_replica = 2
    minilm.save()
    job = _job_with_shards(acme, minilm, [(1.5, 10.0, 100, 7), (0.0, 4.5, 50, 3)])
    assert not JobUsage.objects.exists()
    ended = timezone.now()
    job_transition(
        job_id=str(job.pk),
        source=JobStatus.MERGING,
        target=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=18,
        failed_records=2,
        finished_at=ended,
    )
    usage = JobUsage.objects.get(job=job)
    assert usage.tenant == acme and usage.model == minilm
    assert usage.status == JobStatus.PARTIALLY_SUCCEEDED
    assert (usage.records_succeeded, usage.records_failed) == (18, 2)
    assert (usage.prompt_tokens, usage.completion_tokens) == (150, 10)
    assert usage.gpu_seconds == pytest.approx((1.5 + 10.0 + 4.5) * 2)
    assert usage.period == ended.date().replace(day=1)


def test_a_retried_job_s_second_ending_adds_a_line_of_its_round_s_own(acme: Any, minilm: Any) -> None:
    job = _job_with_shards(acme, minilm, [(0.0, 2.0, 10, 0)])
    job_transition(job_id=str(job.pk), source=JobStatus.MERGING, target=JobStatus.FAILED, failed_records=10)
    job_transition(job_id=str(job.pk), source=JobStatus.FAILED, target=JobStatus.PLANNING, retry_round=1)
    job_transition(job_id=str(job.pk), source=JobStatus.PLANNING, target=JobStatus.RUNNING)
    Shard.objects.create(
        job=job, index=1, round=1, first_record=0, record_count=10, input_uri="x", prefix_uri="y", compute_seconds=3.0
    )
    job_transition(job_id=str(job.pk), source=JobStatus.RUNNING, target=JobStatus.MERGING)
    job_transition(
        job_id=str(job.pk), source=JobStatus.MERGING, target=JobStatus.SUCCEEDED, succeeded_records=10, failed_records=0
    )
    first, retry = JobUsage.objects.filter(job=job).order_by("round")
    assert (first.round, first.status, first.gpu_seconds, first.records_failed) == (0, JobStatus.FAILED, 2.0, 10)
    assert (retry.round, retry.status, retry.gpu_seconds) == (1, JobStatus.SUCCEEDED, pytest.approx(3.0))
    assert (retry.records_succeeded, retry.records_failed) == (10, 0)
    # Both ended this month: the month counts the job once.
    (month,) = usage_per_month(JobUsage.objects.filter(job=job))
    assert (month["jobs"], month["gpu_seconds"]) == (1, pytest.approx(5.0))
    (row,) = chargeback_rows(month=first.period)
    assert (row.jobs, row.gpu_seconds) == (1, pytest.approx(5.0))


def test_a_tenant_past_its_monthly_gpu_seconds_is_refused_naming_the_quota(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    Quota.objects.filter(tenant=acme).update(gpu_seconds_per_month=100)
    path = write_jsonl([{"custom_id": "a", "input": "hello"}])
    job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    JobUsage.objects.create(
        job=_job_with_shards(acme, minilm, []),
        tenant=acme,
        model=minilm,
        period=month_of(timezone.now()),
        status=JobStatus.SUCCEEDED,
        gpu_seconds=100.5,
        recorded_at=timezone.now(),
    )
    # Last month's use does not count against this month.
    JobUsage.objects.filter(period=month_of(timezone.now())).update(
        period=month_of(timezone.now()) - dt.timedelta(days=1)
    )
    job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    JobUsage.objects.update(period=month_of(timezone.now()))
    with pytest.raises(QuotaExceeded) as refused:
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert refused.value.quota == "gpu_seconds_per_month"
    assert refused.value.limit == 100 and refused.value.current == 100.5
