"""The scheduler against the real database and Redis broker: windows, fair order, settling, the reconciler."""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from bench.reconcile import write_commit
from portal.catalog.models import ModelThroughput
from portal.execution import capacity, endings, scheduler
from portal.execution.decayed_usage import usage_read
from portal.execution.endings import ShardEnding, endings_settle, shards_requeue
from portal.execution.endings_inbox import (
    DRAIN_LOCK_KEY,
    INBOX_KEY,
    BatchNotSettled,
    drain,
    endings_report,
)
from portal.execution.reconcile import SETTLE_GRACE_S, jobs_reconcile
from portal.execution.scheduler import schedule_queue
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.tenancy.models import FairShareUsage
from tasks.shared.config import gpu_queue
from tasks.shared.redis_client import redis_client
from tests.factories import GpuClassFactory, ModelFactory, TenantFactory
from tests.support.fleet import live_slots

pytestmark = pytest.mark.django_db(transaction=True)


def _running_job(tenant: Any, model: Any, root: Path, *, shards: int, records: int = 10, **fields: Any) -> Job:
    job = Job.objects.create(
        tenant=tenant,
        model=model,
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        shard_size=records,
        **fields,
    )
    for index in range(shards):
        prefix = root / str(job.pk) / f"shard-{index}"
        Shard.objects.create(
            job=job,
            index=index,
            first_record=index * records,
            record_count=records,
            input_uri=(prefix / "input.jsonl").as_uri(),
            prefix_uri=prefix.as_uri(),
            estimated_seconds=1.0,
        )
    return job


def _dispatched(job: Job) -> int:
    return job.shards.filter(status=ShardStatus.DISPATCHED).count()


def _callbacks_overdue(*jobs: Job) -> None:
    """The jobs' dispatched shards were sent before the sweep's grace: it looks at them in storage."""
    sent_at = timezone.now() - dt.timedelta(seconds=SETTLE_GRACE_S + 1)
    Shard.objects.filter(job__in=jobs, status=ShardStatus.DISPATCHED).update(dispatched_at=sent_at)


def test_a_queue_gets_no_more_than_its_window_shared_by_weight(gpu_class: Any, tmp_path: Path, settings: Any) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 8
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    heavy = _running_job(TenantFactory(name="heavy", weight=3), model, tmp_path, shards=20)
    light = _running_job(TenantFactory(name="light", weight=1), model, tmp_path, shards=20)

    assert schedule_queue(gpu_queue(gpu_class.name)) == 8
    assert schedule_queue(gpu_queue(gpu_class.name)) == 0, "the window is full"

    assert (_dispatched(heavy), _dispatched(light)) == (6, 2)
    usage = usage_read(tenant_ids=[heavy.tenant_id, light.tenant_id], gpu_class_id=gpu_class.pk)
    assert usage[heavy.tenant_id] == pytest.approx(6.0, rel=0.01)
    assert usage[light.tenant_id] == pytest.approx(2.0, rel=0.01)


def test_the_window_is_two_shards_for_each_live_slot_that_consumes_the_queue(gpu_class: Any, tmp_path: Path) -> None:
    queue = gpu_queue(gpu_class.name)
    with live_slots(gpu_class.name, 3):
        model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
        job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=20)
        assert schedule_queue(queue) == 6
        assert _dispatched(job) == 6


def test_a_finished_shard_is_settled_corrected_learned_from_and_its_place_refilled(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 2
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=3)
    schedule_queue(gpu_queue(gpu_class.name))
    first = job.shards.get(index=0)
    write_commit(first, compute_seconds=4.0)

    endings_settle([ShardEnding(str(job.pk), 0)])

    first.refresh_from_db()
    assert (first.status, first.compute_seconds) == (ShardStatus.SUCCEEDED, 4.0)
    assert job.shards.get(index=2).status == ShardStatus.DISPATCHED, "the freed place went to the next shard"
    # Charged 1 s estimate for each of three shards sent, then corrected by the 3 s the first took beyond it.
    assert usage_read(tenant_ids=[job.tenant_id], gpu_class_id=gpu_class.pk)[job.tenant_id] == pytest.approx(
        6.0, rel=0.01
    )
    assert ModelThroughput.objects.get(model=model, gpu_class=gpu_class).observations == 1


def test_the_merge_is_sent_once_no_shard_of_the_job_is_unsettled(
    gpu_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    merges: list[str] = []
    monkeypatch.setattr(endings, "_send_merge", merges.append)
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=2)
    schedule_queue(gpu_queue(gpu_class.name))
    for shard in job.shards.order_by("index"):
        write_commit(shard, compute_seconds=1.0)
        endings_settle([ShardEnding(str(job.pk), shard.index)])
        merges_expected = [str(job.pk)] if shard.index == 1 else []
        assert merges == merges_expected


def test_one_job_with_an_impossible_commit_fails_alone_and_the_sweep_goes_on(gpu_class: Any, tmp_path: Path) -> None:
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    tenant = TenantFactory(name="solo")
    broken = _running_job(tenant, model, tmp_path, shards=1)
    healthy = _running_job(tenant, model, tmp_path, shards=1)
    schedule_queue(gpu_queue(gpu_class.name))
    bad = broken.shards.get()
    write_commit(bad, compute_seconds=1.0)
    Shard.objects.filter(pk=bad.pk).update(record_count=99)  # the commit no longer accounts for the shard
    write_commit(healthy.shards.get(), compute_seconds=1.0)
    _callbacks_overdue(broken, healthy)

    try:
        report = jobs_reconcile()
    finally:
        from tasks.app import app

        with app.connection_for_write() as connection:
            connection.SimpleQueue("control").clear()  # the merge it sent; no worker runs here

    broken.refresh_from_db()
    assert broken.status == JobStatus.FAILED
    assert "committed 10 records but holds 99" in broken.error
    assert healthy.shards.get().status == ShardStatus.SUCCEEDED
    assert (report.failed_jobs, report.merged) == (1, 1)


def test_a_job_whose_storage_cannot_be_read_is_left_for_the_next_sweep_and_the_others_go_on(
    gpu_class: Any, tmp_path: Path
) -> None:
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    tenant = TenantFactory(name="solo")
    unreachable = _running_job(tenant, model, tmp_path, shards=1)
    healthy = _running_job(tenant, model, tmp_path, shards=1)
    schedule_queue(gpu_queue(gpu_class.name))
    Shard.objects.filter(job=unreachable).update(prefix_uri="gs://elsewhere/shard-0")  # no store serves gs://
    write_commit(healthy.shards.get(), compute_seconds=1.0)
    _callbacks_overdue(unreachable, healthy)

    try:
        report = jobs_reconcile()
    finally:
        from tasks.app import app

        with app.connection_for_write() as connection:
            connection.SimpleQueue("control").clear()

    unreachable.refresh_from_db()
    assert unreachable.status == JobStatus.RUNNING, "a passing fault is no reason to fail the job"
    assert healthy.shards.get().status == ShardStatus.SUCCEEDED
    assert (report.failed_jobs, report.merged) == (0, 1)


def test_usage_lives_in_postgresql_and_decays(gpu_class: Any, settings: Any) -> None:
    from portal.execution.decayed_usage import usage_charge

    settings.BATCHERY_FAIR_SHARE_HALF_LIFE_S = 60
    tenant = TenantFactory(name="solo")
    then = timezone.now() - dt.timedelta(seconds=120)
    usage_charge(charges={tenant.pk: 40.0}, gpu_class_id=gpu_class.pk, now=then)

    assert FairShareUsage.objects.get(tenant=tenant).usage == 40.0
    assert usage_read(tenant_ids=[tenant.pk], gpu_class_id=gpu_class.pk)[tenant.pk] == pytest.approx(10.0, rel=0.01)
    assert Counter(usage_read(tenant_ids=[tenant.pk, tenant.pk + 1000], gpu_class_id=gpu_class.pk).values())[0.0] == 1


def test_a_shard_that_arrived_while_its_job_was_paused_waits_again_at_no_cost(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    from celery import states

    from portal.jobs.services.pause import job_pause, job_resume
    from tasks.app import app

    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 1
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=2)
    queue = gpu_queue(gpu_class.name)
    schedule_queue(queue)
    first = job.shards.get(index=0)
    job = job_pause(job=job)
    app.backend.store_result(
        first.task_id, {"job_id": str(job.pk), "shard_index": 0, "skipped": "paused"}, states.SUCCESS
    )

    endings_settle([ShardEnding(str(job.pk), 0)])

    first.refresh_from_db()
    assert (first.status, first.attempt) == (ShardStatus.PENDING, 0)
    assert _dispatched(job) == 0, "nothing of a paused job is sent"
    assert usage_read(tenant_ids=[job.tenant_id], gpu_class_id=gpu_class.pk)[job.tenant_id] == pytest.approx(
        0, abs=1e-3
    )
    job_resume(job=job)
    assert _dispatched(job) == 1
    assert job.shards.get(index=0).status == ShardStatus.DISPATCHED


def test_shards_whose_messages_were_lost_go_back_uncharged_and_are_charged_once_when_sent_again(
    gpu_class: Any, tmp_path: Path
) -> None:
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    lost, kept = TenantFactory(name="lost"), TenantFactory(name="kept")
    lost_job = _running_job(lost, model, tmp_path, shards=2)
    _running_job(kept, model, tmp_path, shards=2)
    queue = gpu_queue(gpu_class.name)
    schedule_queue(queue)

    requeued = shards_requeue(job=lost_job, shards=list(lost_job.shards.all()), reason="Redis restarted empty")
    after_loss = usage_read(tenant_ids=[lost.pk, kept.pk], gpu_class_id=gpu_class.pk)
    schedule_queue(queue)
    after_resend = usage_read(tenant_ids=[lost.pk, kept.pk], gpu_class_id=gpu_class.pk)

    assert requeued == 2
    assert after_loss[lost.pk] == pytest.approx(0, abs=1e-3)
    assert after_loss[kept.pk] == pytest.approx(2.0, rel=0.01)
    assert after_resend[lost.pk] == pytest.approx(after_resend[kept.pk], rel=0.01), "each shard charged once"


def test_with_nothing_left_to_send_idle_slots_get_one_copy_of_each_longest_running_shard(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 8  # four slots, as no heartbeat says otherwise
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=2)
    queue = gpu_queue(gpu_class.name)
    assert schedule_queue(queue) == 2
    Shard.objects.filter(job=job, index=1).update(dispatched_at=timezone.now() - dt.timedelta(seconds=30))

    assert schedule_queue(queue) == 2, "two running shards, two idle slots: a copy of each"
    first, second = job.shards.order_by("index")
    assert first.speculative_task_id.endswith("-copy") and second.speculative_task_id.endswith("-copy")
    assert schedule_queue(queue) == 0, "never a second copy of a shard"


def test_no_copy_while_shards_wait_to_be_sent_or_with_speculation_off(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 8
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=10)
    queue = gpu_queue(gpu_class.name)
    assert schedule_queue(queue) == 8
    Shard.objects.filter(job=job, status=ShardStatus.PENDING).delete()
    Shard.objects.filter(job=job, index__gte=2).update(status=ShardStatus.SUCCEEDED)
    settings.BATCHERY_SPECULATION = False
    assert schedule_queue(queue) == 0
    assert not job.shards.exclude(speculative_task_id="").exists()


def test_endings_that_arrive_while_a_batch_is_settled_are_settled_next_in_one_tick(
    gpu_class: Any, tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 4
    queue = gpu_queue(gpu_class.name)
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=8)
    schedule_queue(queue)
    for shard in job.shards.filter(status=ShardStatus.DISPATCHED):
        write_commit(shard, compute_seconds=1.0)
    client = redis_client()
    ticks = Counter[str]()
    schedule = scheduler.schedule_queue
    monkeypatch.setattr(endings, "schedule_queue", lambda q: ticks.update([q]) or schedule(q))

    # Another callback is settling a batch: these endings wait for it, and their callbacks return.
    held = client.lock(DRAIN_LOCK_KEY.format(queue=queue), timeout=30)
    assert held.acquire(blocking=False)
    for index in range(4):
        endings_report(job_id=str(job.pk), shard_indexes=[index], queue=queue)
    assert _dispatched(job) == 4 and not job.shards.filter(status=ShardStatus.SUCCEEDED).exists()
    held.release()

    assert drain(client, queue) == 4, "the drainer looks again after letting go"

    assert job.shards.filter(status=ShardStatus.SUCCEEDED).count() == 4
    assert _dispatched(job) == 4, "the four places freed were refilled"
    assert ticks == {queue: 1}, "one scheduling tick for the whole batch"
    assert ModelThroughput.objects.get(model=model, gpu_class=gpu_class).observations == 4
    assert client.llen(INBOX_KEY.format(queue=queue)) == 0


def _database_down(endings: Any) -> None:
    from django.db import OperationalError

    raise OperationalError("the database is down")


def test_a_batch_that_fails_gives_its_endings_back_in_order_and_lets_go(
    gpu_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import OperationalError

    from portal.execution import endings_inbox

    queue = gpu_queue(gpu_class.name)
    inbox = INBOX_KEY.format(queue=queue)
    client = redis_client()

    monkeypatch.setattr(endings_inbox, "endings_settle", _database_down)
    try:
        client.rpush(inbox, b"job-a:3", b"job-b:1")
        with pytest.raises(BatchNotSettled) as raised:
            endings_report(job_id="job-a", shard_indexes=[4], queue=queue)

        assert raised.value.transient and isinstance(raised.value.__cause__, OperationalError)
        assert client.lrange(inbox, 0, -1) == [b"job-a:3", b"job-b:1", b"job-a:4"]
        assert client.lock(DRAIN_LOCK_KEY.format(queue=queue), timeout=5).acquire(blocking=False)
    finally:
        client.delete(inbox, DRAIN_LOCK_KEY.format(queue=queue))


def test_a_batch_that_fails_for_good_fails_none_of_the_jobs_whose_endings_it_held(
    gpu_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from portal.execution import endings_inbox
    from tasks.control.shard_done import shard_done

    queue = gpu_queue(gpu_class.name)
    inbox = INBOX_KEY.format(queue=queue)
    client = redis_client()
    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    named = _running_job(TenantFactory(name="named"), model, tmp_path, shards=1)
    other = _running_job(TenantFactory(name="other"), model, tmp_path, shards=1)
    monkeypatch.setattr(endings_inbox, "endings_settle", _database_down)
    monkeypatch.setattr(shard_done, "max_retries", 0)  # its retries are spent
    try:
        client.rpush(inbox, f"{other.pk}:0")
        result = shard_done.apply(args=(str(named.pk), 0, queue))

        assert result.failed() and isinstance(result.result, BatchNotSettled)
        assert client.llen(inbox) == 2, "the endings wait for the next drain"
    finally:
        client.delete(inbox, DRAIN_LOCK_KEY.format(queue=queue))
    named.refresh_from_db()
    other.refresh_from_db()
    assert (named.status, other.status) == (JobStatus.RUNNING, JobStatus.RUNNING), "left to the reconciler"


def test_a_shard_settled_alone_without_redis_fails_its_job_once_the_retries_are_spent(
    gpu_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from portal.execution import endings_inbox
    from tasks.control.shard_done import shard_done

    class RedisDown:
        def rpush(self, *args: Any) -> None:
            raise redis.ConnectionError("Redis is down")

    model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="solo"), model, tmp_path, shards=1)
    monkeypatch.setattr(endings_inbox, "redis_client", RedisDown)
    monkeypatch.setattr(endings_inbox, "endings_settle", _database_down)
    monkeypatch.setattr(shard_done, "max_retries", 0)

    assert shard_done.apply(args=(str(job.pk), 0, gpu_queue(gpu_class.name))).failed()

    job.refresh_from_db()
    assert job.status == JobStatus.FAILED, "its own ending, settled alone: the failure is the job's"


def test_short_shards_get_more_places_a_slot_up_to_a_second_of_work_and_a_cap(settings: Any) -> None:
    settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT = 2
    settings.BATCHERY_SCHEDULER_SECONDS_AHEAD = 1.0
    settings.BATCHERY_SCHEDULER_MAX_SHARDS_PER_SLOT = 64
    assert capacity.shards_per_slot(None) == 2
    assert capacity.shards_per_slot(30.0) == 2, "long shards: the one running and the next"
    assert capacity.shards_per_slot(0.1) == 10
    assert capacity.shards_per_slot(0.0001) == 64


def test_the_longest_waiting_shard_sizes_the_window_so_a_late_tenant_waits_no_longer(
    gpu_class: Any, tmp_path: Path
) -> None:
    queue = gpu_queue(gpu_class.name)
    with live_slots(gpu_class.name, 1):
        model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
        tiny = _running_job(TenantFactory(name="tiny"), model, tmp_path, shards=40)
        Shard.objects.filter(job=tiny).update(estimated_seconds=0.05)
        assert schedule_queue(queue) == 20, "a second of 50 ms shards for the one slot"

        long = _running_job(TenantFactory(name="long"), model, tmp_path, shards=5)
        Shard.objects.filter(job=long).update(estimated_seconds=10.0)
        capacity._cached = None
        assert schedule_queue(queue) == 0, "with 10 s shards waiting, the window is two shards again"


def test_a_jobs_short_first_shards_do_not_widen_the_window_its_full_size_ones_would_fill(
    gpu_class: Any, tmp_path: Path
) -> None:
    queue = gpu_queue(gpu_class.name)
    with live_slots(gpu_class.name, 4):
        model = ModelFactory(name="sched-model", gpu_class=gpu_class, is_default=False)
        early = _running_job(TenantFactory(name="early"), model, tmp_path, shards=30)
        # Cut short for a fast first result, then a second each: what planning gives a fresh job.
        for index, seconds in enumerate([0.1, 0.2, 0.4]):
            Shard.objects.filter(job=early, index=index).update(estimated_seconds=seconds)
        capacity._cached = None
        assert schedule_queue(queue) == 8, "two places a slot: the job's one-second shards size the window"

        late = _running_job(TenantFactory(name="late"), model, tmp_path, shards=5)
        Shard.objects.filter(job=early, status=ShardStatus.DISPATCHED, index__lt=4).update(status=ShardStatus.SUCCEEDED)
        assert schedule_queue(queue) == 4
        assert _dispatched(late) == 4, "the places freed go to the tenant that arrived, at once"


def test_a_queue_whose_tick_fails_does_not_keep_the_sweep_from_filling_the_others(
    gpu_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.app import app

    other_class = GpuClassFactory(name=f"sched{uuid.uuid4().hex[:8]}")
    broken = _running_job(
        TenantFactory(name="a"), ModelFactory(name="m-a", gpu_class=gpu_class, is_default=False), tmp_path, shards=2
    )
    healthy = _running_job(
        TenantFactory(name="b"), ModelFactory(name="m-b", gpu_class=other_class, is_default=False), tmp_path, shards=2
    )
    schedule = scheduler.schedule_queue

    def tick(queue: str) -> int:
        if queue == gpu_queue(gpu_class.name):
            raise ConnectionError("the broker of this class is unreachable")
        return schedule(queue)

    monkeypatch.setattr(scheduler, "schedule_queue", tick)
    try:
        assert scheduler.schedule_all() == 2
    finally:
        with app.connection_for_write() as connection:
            connection.SimpleQueue(gpu_queue(other_class.name)).clear()

    assert (_dispatched(broken), _dispatched(healthy)) == (0, 2)
