"""A scheduling tick reads the jobs of its own queue only: the database narrows them by GPU class and
replica size, so a tick's cost does not grow with the jobs running on the fleet's other queues."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.jobs.models import SCHEDULABLE, Job, JobStatus
from portal.jobs.selectors import queue_jobs
from tests.factories import GpuClassFactory, ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db


def _job(gpu_class: str, gpus: int = 1, status: str = JobStatus.RUNNING) -> Job:
    model = ModelFactory(
        name=f"m-{gpu_class}-{gpus}", gpu_class=GpuClassFactory(name=gpu_class), gpus_per_replica=gpus, is_default=False
    )
    return Job.objects.create(
        tenant=TenantFactory(name=f"t-{uuid.uuid4().hex[:6]}"),
        model=model,
        status=status,
        input_uri="file:///x.jsonl",
        output_uri="file:///out.jsonl",
    )


def test_a_queue_gets_the_jobs_of_its_class_and_size_and_no_other() -> None:
    one = _job("qa")
    two = _job("qa", gpus=2)
    # A class named like a size suffix shares its queue's name with `qa` on two GPUs: both are that queue's.
    named_like_two = _job("qa.x2")
    _job("qb")
    _job("qa", status=JobStatus.SUCCEEDED)

    assert queue_jobs("gpu.qa", statuses=SCHEDULABLE) == [one]
    assert {job.pk for job in queue_jobs("gpu.qa.x2", statuses=SCHEDULABLE)} == {two.pk, named_like_two.pk}
    assert queue_jobs("gpu.qc", statuses=SCHEDULABLE) == []


def test_the_database_returns_only_the_queues_own_jobs() -> None:
    mine = _job("qa")
    for _ in range(5):
        _job("qb")
    with CaptureQueriesContext(connection) as captured:
        assert queue_jobs("gpu.qa", statuses=SCHEDULABLE) == [mine]
    [statement] = captured.captured_queries
    with connection.cursor() as cursor:
        cursor.execute(statement["sql"])
        rows = cursor.fetchall()
    assert len(rows) == 1, "the other queue's five jobs were read and thrown away"
