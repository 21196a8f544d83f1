"""Retention: the shard rows and events of jobs that ended long ago are removed by the sweep, in bounded
statements, and such a job still answers on its page, the API and the Batch API."""

from __future__ import annotations

import datetime as dt
import importlib
import uuid
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.jobs.models import FINAL_STATUSES, Job, JobEvent, JobStatus, JobUsage, Shard, ShardStatus
from portal.jobs.services.retention import PRUNE_GRACE, jobs_prune
from portal.jobs.services.retry import CannotRetry, job_retry, job_retryable
from portal.jobs.usage import usage_record
from portal.openai_api.models import Batch
from portal.tenancy.models import BudgetHold, Tenant
from tasks.app import app
from tasks.shared.config import CONTROL_QUEUE, RETENTION_TASK, TASK_QUEUES, celery_settings
from tests.api.conftest import make_caller

pytestmark = pytest.mark.django_db

DAY = dt.timedelta(days=1)


def ended_job(tenant: Tenant, model: Any, *, ended: dt.datetime | None, shards: int = 3, **fields: Any) -> Job:
    """A job as the pipeline leaves it: its shards settled, its events written, its ledger line; `ended`
    None leaves it running."""
    job_id = uuid.uuid4()
    status = fields.pop("status", JobStatus.SUCCEEDED if ended else JobStatus.RUNNING)
    defaults: dict[str, Any] = {
        "input_uri": "file:///data/input.jsonl",
        "output_uri": f"file:///nowhere/{job_id}/output.jsonl",
        "errors_uri": f"file:///nowhere/{job_id}/errors.jsonl",
        "total_records": shards * 10,
        "succeeded_records": shards * 10 if ended else 0,
        "shard_count": shards,
        "started_at": (ended or timezone.now()) - dt.timedelta(minutes=5),
        "finished_at": ended,
    }
    job = Job.objects.create(id=job_id, tenant=tenant, model=model, status=status, **{**defaults, **fields})
    Shard.objects.bulk_create(
        Shard(
            job=job,
            index=index,
            first_record=index * 10,
            record_count=10,
            input_uri=f"file:///nowhere/{job_id}/input/shard-{index:05d}.jsonl",
            prefix_uri=f"file:///nowhere/{job_id}/shards/{index:05d}",
            status=ShardStatus.SUCCEEDED if ended else ShardStatus.DISPATCHED,
            succeeded_records=10 if ended else 0,
            prompt_tokens=7,
            attempt=1,
            worker="slot-0@test",
        )
        for index in range(shards)
    )
    steps = [JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING]
    if ended:
        steps += [JobStatus.MERGING, status]
    for step in steps:
        JobEvent.objects.create(job=job, status=step)
    if ended:
        JobEvent.objects.filter(job=job).update(at=ended)
        usage_record(job=job)
    return job


def rows(job: Job) -> tuple[int, int]:
    return Shard.objects.filter(job=job).count(), JobEvent.objects.filter(job=job).count()


def test_a_job_that_ended_past_the_retention_loses_its_shards_and_events_and_keeps_its_timeline(
    acme: Tenant, minilm: Any
) -> None:
    now = timezone.now()
    old = ended_job(acme, minilm, ended=now - 31 * DAY, shards=4)
    BudgetHold.objects.create(tenant=acme, job_id=old.pk, amount=Decimal("1.25"))
    steps = list(JobEvent.objects.filter(job=old).order_by("at", "pk").values_list("status", "at"))

    report = jobs_prune(now=now)

    assert rows(old) == (0, 0)
    assert (report.jobs, report.shards, report.events, report.holds) == (1, 4, 5, 1)
    assert not BudgetHold.objects.filter(job_id=old.pk).exists(), "an ended job's budget hold counts no more"
    old.refresh_from_db()
    assert old.pruned_at == now
    assert [(status, dt.datetime.fromisoformat(at)) for status, at in old.timeline] == steps
    # The counts stay on the job, and the ledger line stays whole.
    assert (old.shard_count, old.total_records, old.succeeded_records) == (4, 40, 40)
    assert JobUsage.objects.get(job=old).prompt_tokens == 28
    assert jobs_prune(now=now).jobs == 0


def test_recent_endings_and_unfinished_jobs_keep_their_rows(acme: Tenant, minilm: Any) -> None:
    now = timezone.now()
    recent = ended_job(acme, minilm, ended=now - 29 * DAY)
    in_grace = ended_job(acme, minilm, ended=now - 30 * DAY - PRUNE_GRACE / 2)
    running = ended_job(acme, minilm, ended=None)
    Job.objects.filter(pk=running.pk).update(created_at=now - 90 * DAY)
    old = ended_job(acme, minilm, ended=now - 40 * DAY)
    for job in (recent, running):
        BudgetHold.objects.create(tenant=acme, job_id=job.pk, amount=Decimal("1"))

    jobs_prune(now=now)

    assert rows(recent) == rows(in_grace) == (3, 5)
    assert rows(running) == (3, 3)
    assert BudgetHold.objects.filter(job_id__in=[recent.pk, running.pk]).count() == 2
    assert rows(old) == (0, 0)
    assert set(Job.objects.filter(pruned_at__isnull=False).values_list("pk", flat=True)) == {old.pk}


def test_every_ending_is_pruned(acme: Tenant, minilm: Any) -> None:
    now = timezone.now()
    jobs = [ended_job(acme, minilm, ended=now - 31 * DAY, status=status) for status in FINAL_STATUSES]

    jobs_prune(now=now)

    assert all(rows(job) == (0, 0) for job in jobs)


def test_a_retention_of_zero_keeps_every_row(acme: Tenant, minilm: Any, settings: Any) -> None:
    settings.BATCHERY_SHARD_RETENTION_DAYS = 0
    now = timezone.now()
    ancient = ended_job(acme, minilm, ended=now - 3650 * DAY, failed_records=1, status=JobStatus.PARTIALLY_SUCCEEDED)

    report = jobs_prune(now=now)

    assert report.jobs == report.shards == 0
    assert rows(ancient) == (3, 5)
    assert job_retryable(ancient, now=now)


def test_shard_rows_go_in_bounded_deletes(acme: Tenant, minilm: Any) -> None:
    now = timezone.now()
    jobs = [ended_job(acme, minilm, ended=now - 31 * DAY, shards=6) for _ in range(2)]

    with CaptureQueriesContext(connection) as queries:
        report = jobs_prune(now=now, rows_per_delete=5, jobs_per_pass=1)

    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('DELETE FROM "jobs_shard"')]
    # Two passes of one job each: 5 rows, then the last 1 (fewer than asked: the job is done).
    assert len(deletes) == report.deletes == 4
    assert all(sql.endswith("LIMIT 5)") for sql in deletes)
    assert report.shards == 12 and all(rows(job) == (0, 0) for job in jobs)


def test_a_sweep_stopped_halfway_is_finished_by_the_next(acme: Tenant, minilm: Any) -> None:
    now = timezone.now()
    job = ended_job(acme, minilm, ended=now - 31 * DAY, shards=6)

    assert jobs_prune(now=now, budget_s=0).shards == 0
    # As a sweep that died after its first DELETE leaves it: some rows gone, the job not marked.
    Shard.objects.filter(job=job, index__lt=2).delete()
    report = jobs_prune(now=now)

    assert (report.jobs, report.shards) == (1, 4)
    assert rows(job) == (0, 0)


def test_retry_is_refused_once_the_retention_has_passed(acme: Tenant, minilm: Any) -> None:
    now = timezone.now()
    job = ended_job(
        acme, minilm, ended=now - 31 * DAY, status=JobStatus.PARTIALLY_SUCCEEDED, failed_records=3, succeeded_records=27
    )
    # Past the retention the job can no longer be retried, before the sweep removes its rows and after.
    assert not job_retryable(job, now=now)
    with pytest.raises(CannotRetry, match="re-run"):
        job_retry(job=job)
    jobs_prune(now=now)
    job.refresh_from_db()
    with pytest.raises(CannotRetry, match="no longer retried"):
        job_retry(job=job)
    recent = ended_job(
        acme, minilm, ended=now - 29 * DAY, status=JobStatus.PARTIALLY_SUCCEEDED, failed_records=3, succeeded_records=27
    )
    assert job_retryable(recent, now=now)


def test_a_pruned_job_answers_on_the_api_its_page_and_the_batch_api(acme: Tenant, minilm: Any) -> None:
    now = timezone.now()
    job = ended_job(acme, minilm, ended=now - 31 * DAY, shards=4)
    batch = Batch.objects.create(
        id=f"batch_{uuid.uuid4().hex}",
        tenant=acme,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id="file-x",
        job=job,
        finalized_at=job.finished_at,
    )
    caller = make_caller(acme)
    before = caller.client.get(f"/api/v1/jobs/{job.pk}/").json()
    batch_before = caller.client.get(f"/v1/batches/{batch.id}").json()

    jobs_prune(now=now)

    assert rows(job) == (0, 0)
    after = caller.client.get(f"/api/v1/jobs/{job.pk}/").json()
    assert after == before
    assert after["shard_count"] == 4 and after["succeeded_records"] == 40 and after["output_url"]
    batch_after = caller.client.get(f"/v1/batches/{batch.id}").json()
    assert batch_after == batch_before
    assert batch_after["in_progress_at"] and batch_after["finalizing_at"] and batch_after["usage"]["input_tokens"] == 28
    page = Client()
    page.force_login(caller.user)
    html = page.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="shards-pruned"' in html and "4 shards" in html
    timeline = html.split('id="timeline"', 1)[1].split("</ol>", 1)[0]
    assert timeline.count("<li") == 5 and ">merging</span>" in timeline
    assert str(job.pk) in page.get("/").content.decode()


def test_the_control_worker_beat_runs_the_sweep() -> None:
    schedule = celery_settings()["beat_schedule"]

    assert any(entry["task"] == RETENTION_TASK for entry in schedule.values())
    # The control worker imports its task modules (`include`) as it starts.
    for module in app.conf.include:
        importlib.import_module(module)
    assert RETENTION_TASK in app.tasks and TASK_QUEUES[RETENTION_TASK] == CONTROL_QUEUE
