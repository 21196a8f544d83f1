"""The scheduler and settling when Redis or another tick gets in the way: a callback that loses Redis
retries, and a tick that finds its queue's lock held asks the holder to tick again."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import connection, connections, transaction

from bench.reconcile import write_commit
from portal.execution import endings_inbox, scheduler
from portal.execution.locks import lock_until_commit
from portal.execution.scheduler import schedule_queue
from portal.jobs.models import JobStatus, ShardStatus
from tasks.control.shard_done import shard_done
from tasks.shared.config import gpu_queue
from tasks.shared.redis_client import redis_client
from tests.execution.test_scheduler import _dispatched, _running_job
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_callback_that_loses_redis_while_draining_retries_and_fails_no_job(
    gpu_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarting under a drainer is an outage like the database's: the callback waits it out."""
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    # Two shards, one of which ends: the job's merge is not sent. Where the session's pipeline workers
    # run (CI), a merge sent here would write to the database while this test's teardown truncates it.
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=2)
    queue = gpu_queue(gpu_class.name)
    schedule_queue(queue)
    write_commit(job.shards.get(index=0), compute_seconds=1.0)
    calls = Counter[str]()
    real_drain = endings_inbox.drain

    def drain_once_without_redis(client: Any, queue: str) -> int:
        calls.update(["drain"])
        if calls["drain"] == 1:
            raise redis.ConnectionError("Connection closed by server.")
        return real_drain(client, queue)

    monkeypatch.setattr(endings_inbox, "drain", drain_once_without_redis)

    assert shard_done.apply(args=(str(job.pk), [0], queue)).successful()

    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING, job.error
    assert calls["drain"] == 2, "retried"
    assert job.shards.get(index=0).status == ShardStatus.SUCCEEDED


def test_a_tick_that_finds_its_queue_held_asks_the_holder_to_tick_again_instead_of_waiting(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 4
    queue = gpu_queue(gpu_class.name)
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=4)
    again = scheduler.AGAIN_KEY.format(queue=queue)
    redis_client().delete(again)
    held, release = threading.Event(), threading.Event()

    def another_tick_under_way() -> None:
        try:
            with transaction.atomic():
                lock_until_commit(f"batchery:schedule:{queue}")
                held.set()
                release.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=another_tick_under_way)
    holder.start()
    try:
        assert held.wait(10)
        answers: list[int] = []
        asker = threading.Thread(target=lambda: answers.append(schedule_queue(queue)) or connection.close())
        asker.start()
        asker.join(10)
        assert answers == [0], "the tick waited for the lock's holder instead of asking it to tick again"
        assert redis_client().get(again) == b"1"
        assert _dispatched(job) == 0
    finally:
        release.set()
        holder.join(10)

    # The holder, once it let go, takes the ask and ticks again: here the next tick's holder does.
    assert schedule_queue(queue) == 4
    assert redis_client().get(again) is None, "the ask was taken"
    assert _dispatched(job) == 4
