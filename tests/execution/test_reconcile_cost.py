"""The reconciler's sweep costs what went wrong, not how much runs: storage is asked about the shards
that have no live lease and were sent before the grace, never about the others."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from bench.reconcile import count_storage_requests, hold_leases, simulate_running_jobs, write_commit
from portal.execution import capacity
from portal.execution.reconcile import SETTLE_GRACE_S, jobs_reconcile
from portal.jobs.models import Job, ShardStatus
from tasks.shared.config import gpu_queue
from tasks.shared.redis_client import redis_client
from tests.factories import GpuClassFactory, ModelFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def model() -> Iterator[Any]:
    """A model on a GPU class of its own, whose queue holds only this test's messages."""
    from tasks.app import app

    gpu_class = GpuClassFactory(name=f"recon{uuid.uuid4().hex[:8]}")
    capacity._cached = None
    yield ModelFactory(name="recon-model", gpu_class=gpu_class, is_default=False)
    with app.connection_for_write() as connection:
        connection.SimpleQueue(gpu_queue(gpu_class.name)).clear()
        connection.SimpleQueue("control").clear()
    capacity._cached = None


@pytest.fixture
def leases() -> Iterator[list[str]]:
    keys: list[str] = []
    yield keys
    if keys:
        redis_client().delete(*keys)


def _sweep_requests(root: Path) -> int:
    """Storage requests of one sweep for objects under `root` (the catalog it publishes is elsewhere)."""
    with count_storage_requests(under=root.as_uri()) as counts:
        jobs_reconcile()
    return sum(counts.values())


@pytest.mark.parametrize("shards", [50, 400])
def test_a_sweep_over_fresh_or_held_shards_asks_storage_only_about_the_unattended_ones(
    model: Any, tmp_path: Path, leases: list[str], shards: int
) -> None:
    old = timezone.now() - dt.timedelta(seconds=SETTLE_GRACE_S + 60)
    fresh_job, held_job, unattended_job = (
        simulate_running_jobs(root=tmp_path, jobs=1, shards_per_job=count, sent_at=sent_at, model=model)[0]
        for count, sent_at in ((shards, timezone.now()), (shards, old), (2, old))
    )
    leases += hold_leases([(str(held_job.pk), index) for index in range(shards)], ttl_s=60)
    # Committed shards whose callbacks are on their way: their callbacks settle them, not the sweep.
    for job in (fresh_job, held_job):
        for shard in job.shards.filter(index__lt=5):
            write_commit(shard)
    write_commit(unattended_job.shards.get(index=0))  # its callback was lost

    requests = _sweep_requests(tmp_path)

    # The unattended committed shard: exists and read; the other: exists. Nothing else, whatever `shards` is.
    assert requests == 3
    assert dict(unattended_job.shards.values_list("index", "status")) == {
        0: ShardStatus.SUCCEEDED,
        1: ShardStatus.PENDING,  # no lease, no message: given back to the scheduler
    }
    for job in (fresh_job, held_job):
        assert Job.objects.get(pk=job.pk).shards.exclude(status=ShardStatus.DISPATCHED).count() == 0


def test_a_sweep_asks_the_database_and_redis_as_often_for_ten_running_jobs_as_for_two(
    model: Any, tmp_path: Path, leases: list[str]
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def statements(jobs: int) -> int:
        old = timezone.now() - dt.timedelta(seconds=SETTLE_GRACE_S + 60)
        running = simulate_running_jobs(
            root=tmp_path / str(jobs), jobs=jobs, shards_per_job=3, sent_at=old, model=model
        )
        # Every shard held by a live attempt: a healthy fleet's sweep, which finds nothing to do.
        leases.extend(hold_leases([(str(job.pk), index) for job in running for index in range(3)], ttl_s=60))
        with CaptureQueriesContext(connection) as captured:
            jobs_reconcile()
        Job.objects.filter(pk__in=[job.pk for job in running]).delete()
        return len(captured.captured_queries)

    assert statements(10) == statements(2)
