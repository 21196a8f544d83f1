"""A job's priority (capped by its tenant's) is its shards' broker priority: the real Redis broker serves them first."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from portal.execution.scheduler import schedule_queue
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.submit import job_submit
from tasks.shared.config import gpu_queue, message_priority
from tests.factories import GpuClassFactory, ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db


def test_priority_scale_is_turned_round_for_redis() -> None:
    assert [message_priority(p) for p in (0, 5, 9, 42, -1)] == [9, 4, 0, 0, 9]


def _running_job(tenant: Any, model: Any, shards: int, priority: int | None = None) -> Job:
    job = Job.objects.create(
        tenant=tenant,
        model=model,
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        shard_size=1,
        priority=priority,
    )
    for index in range(shards):
        Shard.objects.create(
            job=job, index=index, first_record=index, record_count=1, input_uri="file:///x", prefix_uri="file:///y"
        )
    return job


def test_shards_of_a_higher_priority_tenant_are_delivered_before_those_queued_earlier(settings: Any) -> None:
    from tasks.app import app

    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 20

    gpu_class = GpuClassFactory(name=f"prio{uuid.uuid4().hex[:8]}")
    model = ModelFactory(name="prio-model", gpu_class=gpu_class, is_default=False)
    high_tenant = TenantFactory(name="high", priority=9)
    low = _running_job(TenantFactory(name="low", priority=1), model, shards=3)
    background = _running_job(high_tenant, model, shards=3, priority=0)
    high = _running_job(high_tenant, model, shards=3)
    assert schedule_queue(gpu_queue(gpu_class.name)) == 9

    delivered = []
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(gpu_queue(gpu_class.name))
        try:
            for _ in range(9):
                message = queue.get(timeout=5)
                delivered.append(message.headers["id"].split("-", 6)[1:6])
                message.ack()
        finally:
            queue.clear()
            queue.close()
    jobs = ["-".join(parts) for parts in delivered]
    # The high tenant's background job (priority 0) runs after even the low tenant's.
    assert jobs == [str(high.pk)] * 3 + [str(low.pk)] * 3 + [str(background.pk)] * 3


def test_a_job_may_not_ask_for_more_priority_than_its_tenant_has(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"custom_id": "a", "input": "hello"}])
    with pytest.raises(SubmissionError, match=r"priority must be from 0 to 5 \(the tenant's own priority\), not 7"):
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), priority=7))
    assert (
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), priority=2)).priority
        == 2
    )
