"""A running job stops at its tenant's monthly budget as its shards settle: no new shard starts, what
finished is kept and downloadable, the rest are `budget_exceeded` error lines, the ending names the budget.
Real PostgreSQL, Redis and files; no worker runs here."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.utils import timezone

from bench.reconcile import write_commit
from portal.execution import budget_stop
from portal.execution.endings import ShardEnding, endings_settle
from portal.execution.merge import BUDGET_STOP, job_merge
from portal.jobs.models import Job, JobStatus, Shard
from portal.tenancy.models import Quota
from tasks.shared.stops import stop_reason
from tests.factories import ModelFactory, TenantFactory
from tests.support.ledger import price

pytestmark = pytest.mark.django_db(transaction=True)

RECORDS = 3


@pytest.fixture
def merges_sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    sent: list[tuple[str, str | None]] = []
    monkeypatch.setattr(budget_stop.send, "send_merge", lambda job_id, stop=None: sent.append((job_id, stop)))
    return sent


def _two_shard_job(root: Path, gpu_class: Any, *, budget: str | None, running_s: float = 1.0) -> Job:
    """A running job of two shards whose first ran 100 GPU-seconds (at 1 each) and committed; the second, expected
    to take `running_s`, runs."""
    model = ModelFactory(name="budget-model", gpu_class=gpu_class, is_default=False)
    price(model, per_gpu_second="1", effective_from=timezone.now().date())
    tenant = TenantFactory(name="thrifty")
    Quota.objects.update_or_create(
        tenant=tenant, defaults={"monthly_budget": None if budget is None else Decimal(budget)}
    )
    job = Job.objects.create(
        tenant=tenant,
        model=model,
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        errors_uri=(root / "errors.jsonl").as_uri(),
        shard_size=RECORDS,
        shard_count=2,
        total_records=2 * RECORDS,
        started_at=timezone.now(),
    )
    for index in range(2):
        prefix = root / str(job.pk) / f"shard-{index}"
        prefix.mkdir(parents=True)
        ids = [f"r{index * RECORDS + i}" for i in range(RECORDS)]
        (prefix / "input.jsonl").write_bytes(
            b"".join(orjson.dumps({"custom_id": i, "input": "x"}) + b"\n" for i in ids)
        )
        (prefix / "out.jsonl").write_bytes(
            b"".join(orjson.dumps({"custom_id": i, "response": {"label": "x"}}) + b"\n" for i in ids)
        )
        (prefix / "errors.jsonl").write_bytes(b"")
        Shard.objects.create(
            job=job,
            index=index,
            first_record=index * RECORDS,
            record_count=RECORDS,
            input_uri=(prefix / "input.jsonl").as_uri(),
            prefix_uri=prefix.as_uri(),
            estimated_seconds=running_s,
            status="dispatched",
        )
    write_commit(job.shards.get(index=0), compute_seconds=100.0)
    return job


def test_a_running_job_that_reaches_its_budget_stops_and_keeps_its_finished_work(
    gpu_class: Any, tmp_path: Path, merges_sent: list[tuple[str, str | None]]
) -> None:
    job = _two_shard_job(tmp_path, gpu_class, budget="50")

    endings_settle([ShardEnding(str(job.pk), 0)])

    assert merges_sent == [(str(job.pk), BUDGET_STOP)]
    assert stop_reason(str(job.pk)) == BUDGET_STOP  # shards arriving from now on do not start
    job_merge(job_id=str(job.pk), stop=BUDGET_STOP)
    job.refresh_from_db()
    assert (job.status, job.succeeded_records, job.failed_records) == (JobStatus.PARTIALLY_SUCCEEDED, 3, 3)
    assert "monthly budget" in job.error and BUDGET_STOP in job.error
    lines = [orjson.loads(line) for line in (tmp_path / "output.jsonl").read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"r{n}" for n in range(6)]
    assert all("response" in line for line in lines[:3])
    assert {line["error"]["code"] for line in lines[3:]} == {BUDGET_STOP}


def test_a_job_within_its_budget_or_without_one_runs_on(
    gpu_class: Any, tmp_path: Path, merges_sent: list[tuple[str, str | None]]
) -> None:
    within = _two_shard_job(tmp_path / "a", gpu_class, budget="500")
    endings_settle([ShardEnding(str(within.pk), 0)])
    assert merges_sent == [] and Job.objects.get(pk=within.pk).status == JobStatus.RUNNING


def test_the_shards_still_running_count_at_their_estimate(
    gpu_class: Any, tmp_path: Path, merges_sent: list[tuple[str, str | None]]
) -> None:
    job = _two_shard_job(tmp_path, gpu_class, budget="150", running_s=60.0)  # 100 settled + 60 running
    endings_settle([ShardEnding(str(job.pk), 0)])
    assert merges_sent == [(str(job.pk), BUDGET_STOP)]
