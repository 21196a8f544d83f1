"""A retry holds the tenant's quota and budget as a submission does (the usual 429 past them), and only
records the retry: the round is cut on the planning lane, streaming, each shard input read once."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import BudgetHold, Quota
from tasks.shared.storage import store_for
from tests.api.conftest import Caller
from tests.support.ledger import price

pytestmark = pytest.mark.django_db

RECORDS = 10
FAILED = [1, 4, 5, 9]


@pytest.fixture
def ended_with_failures(
    caller: Callable[..., Caller],
    minilm: Any,
    write_jsonl: Callable[..., Path],
    django_capture_on_commit_callbacks: Any,
) -> tuple[Caller, Job]:
    """A job of ten records in shards of three that ended partially succeeded, four records failed."""
    alice = caller("acme")
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(RECORDS)])
    job = job_submit(tenant=alice.tenant, request=JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=3))
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    with store_for(job.errors_uri).open_write(job.errors_uri) as errors:
        for n in FAILED:
            errors.write(b'{"custom_id": "r%d", "error": {"code": "model_error", "message": "boom"}}\n' % n)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=RECORDS - len(FAILED),
        failed_records=len(FAILED),
        finished_at=timezone.now(),
    )
    job.refresh_from_db()
    return alice, job


def _retry(alice: Caller, job: Job) -> Any:
    return alice.client.post(f"/api/v1/jobs/{job.pk}/retry/")


def test_a_retry_past_max_concurrent_jobs_is_refused_with_429_and_the_job_stays_as_it_ended(
    ended_with_failures: tuple[Caller, Job], minilm: Any
) -> None:
    alice, job = ended_with_failures
    Job.objects.create(tenant=alice.tenant, model=minilm, input_uri="file:///other.jsonl")  # queued
    Quota.objects.filter(tenant=alice.tenant).update(max_concurrent_jobs=1)
    response = _retry(alice, job)
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("quota_exceeded", "max_concurrent_jobs")
    job.refresh_from_db()
    assert (job.status, job.retry_round) == (JobStatus.PARTIALLY_SUCCEEDED, 0)


def test_a_retry_past_the_queued_records_or_the_budget_is_refused_with_429(
    ended_with_failures: tuple[Caller, Job], minilm: Any
) -> None:
    alice, job = ended_with_failures
    Quota.objects.filter(tenant=alice.tenant).update(max_queued_records=RECORDS - 1)
    assert _retry(alice, job).json()["error"]["param"] == "max_queued_records"
    Quota.objects.filter(tenant=alice.tenant).update(max_queued_records=None, monthly_budget=Decimal("0.01"))
    price(minilm, per_gpu_second="1", effective_from=timezone.now().date())
    BudgetHold.objects.update_or_create(job_id=job.pk, defaults={"tenant": alice.tenant, "amount": Decimal(10)})
    response = _retry(alice, job)
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert error["param"] == "monthly_budget" and Decimal(error["quota"]["requested"]) == Decimal(4)  # 4/10 of 10
    assert Job.objects.get(pk=job.pk).status == JobStatus.PARTIALLY_SUCCEEDED


def test_a_retry_within_the_quota_holds_its_round_and_leaves_the_cut_to_the_planning_lane(
    ended_with_failures: tuple[Caller, Job], django_capture_on_commit_callbacks: Any
) -> None:
    alice, job = ended_with_failures
    Quota.objects.filter(tenant=alice.tenant).update(max_concurrent_jobs=1, monthly_budget=Decimal(100))
    BudgetHold.objects.update_or_create(job_id=job.pk, defaults={"tenant": alice.tenant, "amount": Decimal(10)})
    errors = store_for(job.errors_uri).read_bytes(job.errors_uri)
    store_for(job.errors_uri).delete_prefix(job.errors_uri)  # the request does not read it

    response = _retry(alice, job)

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "planning"
    assert not Shard.objects.filter(job=job, round=1).exists()
    assert BudgetHold.objects.get(job_id=job.pk).amount == Decimal(4)
    with store_for(job.errors_uri).open_write(job.errors_uri) as target:
        target.write(errors)
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.pk))
    job.refresh_from_db()
    assert (job.status, job.retry_round) == (JobStatus.RUNNING, 1)
    cut = [
        line
        for shard in Shard.objects.filter(job=job, round=1).order_by("index")
        for line in store_for(shard.input_uri).read_bytes(shard.input_uri).splitlines()
    ]
    assert [line.split(b'"custom_id":"')[1].split(b'"')[0].decode() for line in cut] == [f"r{n}" for n in FAILED]


def test_the_round_is_cut_reading_the_error_file_and_each_shard_input_once(
    ended_with_failures: tuple[Caller, Job], django_capture_on_commit_callbacks: Any, monkeypatch: Any
) -> None:
    from portal.execution import retry_round

    alice, job = ended_with_failures
    opened: list[str] = []

    store = store_for(job.errors_uri)  # one store for the job's files
    real = store.open_read

    def open_read(target: str) -> Any:
        opened.append(target)
        return real(target)

    monkeypatch.setattr(store, "open_read", open_read)

    def counting(uri: str) -> Any:
        assert store_for(uri) is store
        return store

    monkeypatch.setattr(retry_round, "store_for", counting)
    assert _retry(alice, job).status_code == 200
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.pk))
    inputs = list(Shard.objects.filter(job=job, round=0).order_by("index").values_list("input_uri", flat=True))
    # The last failed record is in the last shard: every input is read, each once, after the error file.
    assert opened == [job.errors_uri, *inputs]
