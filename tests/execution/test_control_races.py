"""Several control processes at once, against the real database: what one does between another's read
and its write must not send, settle, fail or charge a shard twice.

Each race is forced, not hoped for: the other process's transaction (a thread with a connection of its
own) writes first and holds its row lock until this one's statement waits for it (`_commit_once_waited_on`),
so that the statement runs on the row as the other process left it, as it does when the two interleave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import states
from django.db import connection, transaction

from bench.reconcile import write_commit
from portal.execution.decayed_usage import usage_read
from portal.execution.endings import shards_requeue
from portal.execution.locks import held_unless_taken
from portal.execution.merge import MERGE_LOCK, job_merge
from portal.execution.reconcile import jobs_reconcile
from portal.execution.scheduler import schedule_queue
from portal.execution.settle import SettleBatch, Settled, SettleLedger
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from tasks.app import app
from tasks.shared.config import SHARD_MAX_DISPATCHES, gpu_queue
from tests.execution.test_inline_merge import _finished_one_shard_job
from tests.execution.test_scheduler import _callbacks_overdue, _running_job
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _settle(job: Job, shards: list[Shard]) -> list[tuple[Shard, Settled]]:
    """Settle the job's shards as a batch of endings or a sweep does."""
    batch = SettleBatch(SettleLedger())
    outcomes = batch.examine(job, shards)
    batch.write()
    batch.ledger.flush()
    return outcomes


def _someone_waits_on_me() -> bool:
    """Whether another backend waits for a lock this connection holds (pg_locks is read live, even in a
    transaction, unlike pg_stat_activity)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND pg_backend_pid() = ANY(pg_blocking_pids(pid))"
        )
        (waiting,) = cursor.fetchone()
    return bool(waiting)


@contextmanager
def _other_process_writes(write: Callable[[], None]) -> Iterator[None]:
    """Run `write` in another connection's transaction, which commits once a statement of the block
    waits on its locks (or after 10 s, which fails the test that needed the wait)."""
    written, waited_on = threading.Event(), threading.Event()

    def other() -> None:
        try:
            with transaction.atomic():
                write()
                written.set()
                deadline = time.monotonic() + 10
                while not _someone_waits_on_me() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if time.monotonic() < deadline:
                    waited_on.set()
        finally:
            written.set()
            connection.close()

    thread = threading.Thread(target=other)
    thread.start()
    written.wait()
    try:
        yield
    finally:
        thread.join()
    assert waited_on.is_set(), "the block's statement did not wait for the other process's row lock"


def test_a_shard_settled_by_another_process_while_a_tick_sends_it_is_not_sent_or_charged_again(
    gpu_class: Any, tmp_path: Path
) -> None:
    # A shard sent again (its first message judged lost) whose first attempt did run: its late callback,
    # settled by another control process, finds it committed while a tick of this one sends it.
    model = ModelFactory(name="race-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="racer"), model, tmp_path, shards=1)
    queue = gpu_queue(gpu_class.name)
    schedule_queue(queue)
    shard = job.shards.get()
    shards_requeue(job=job, shards=[shard], reason="its message looked lost")
    write_commit(shard, compute_seconds=4.0)
    late = job.shards.get()

    with _other_process_writes(lambda: _settle(Job.objects.select_related("model").get(pk=job.pk), [late])):
        sent = schedule_queue(queue)

    late.refresh_from_db()
    assert sent == 0, "the tick sends no shard that was settled under it"
    assert late.status == ShardStatus.SUCCEEDED
    assert late.attempt == 1, "dispatched once"
    # Charged the 1 s estimate, refunded it when sent again, then the settling's correction (4 s less 1 s):
    # the tick charged nothing.
    usage = usage_read(tenant_ids=[job.tenant_id], gpu_class_id=gpu_class.pk)[job.tenant_id]
    assert usage == pytest.approx(3.0, rel=0.01)


def test_a_shard_given_up_by_a_sweep_keeps_the_success_another_process_settled(gpu_class: Any, tmp_path: Path) -> None:
    model = ModelFactory(name="race-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="racer"), model, tmp_path, shards=1)
    schedule_queue(gpu_queue(gpu_class.name))
    Shard.objects.filter(job=job).update(attempt=SHARD_MAX_DISPATCHES)
    seen_by_sweep = job.shards.get()
    write_commit(seen_by_sweep, compute_seconds=1.0)

    with _other_process_writes(lambda: _settle(Job.objects.select_related("model").get(pk=job.pk), [seen_by_sweep])):
        shards_requeue(job=job, shards=[seen_by_sweep], reason="sent too often")

    assert job.shards.get().status == ShardStatus.SUCCEEDED


def test_a_task_failure_read_before_another_process_settled_the_shard_does_not_overwrite_its_success(
    gpu_class: Any, tmp_path: Path
) -> None:
    model = ModelFactory(name="race-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="racer"), model, tmp_path, shards=1)
    schedule_queue(gpu_queue(gpu_class.name))
    shard = job.shards.get()
    # The shard's own task failed for good; a copy of it committed, which another process settles
    # after this one found no commit marker and read the failure.
    app.backend.store_result(shard.task_id, RuntimeError("the engine crashed"), states.FAILURE)

    def copy_settled() -> None:
        Shard.objects.filter(pk=shard.pk).update(status=ShardStatus.SUCCEEDED, attempt_id="copy")

    with _other_process_writes(copy_settled):
        [(_, settled)] = _settle(Job.objects.select_related("model").get(pk=job.pk), [shard])

    assert settled is not Settled.FAILED
    assert job.shards.get().status == ShardStatus.SUCCEEDED


def test_two_sweeps_at_once_send_each_lost_shard_once_and_charge_it_once(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    # Two beats by mistake, or a sweep that outlasts the interval: both judge the same shards lost.
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 4
    model = ModelFactory(name="race-model", gpu_class=gpu_class, is_default=False)
    job = _running_job(TenantFactory(name="racer"), model, tmp_path, shards=4)
    queue = gpu_queue(gpu_class.name)
    schedule_queue(queue)
    with app.connection_for_write() as broker:
        broker.SimpleQueue(queue).clear()  # every message lost (Redis restarted empty)
    _callbacks_overdue(job)
    barrier = threading.Barrier(2)

    def sweep() -> Any:
        try:
            barrier.wait()
            return jobs_reconcile()
        finally:
            connection.close()

    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda _: sweep(), range(2)))

    assert sum(report.resent_shards for report in reports) == 4, reports
    assert sorted(job.shards.values_list("attempt", flat=True)) == [2, 2, 2, 2], "each sent again once"
    assert set(job.shards.values_list("status", flat=True)) == {ShardStatus.DISPATCHED}
    usage = usage_read(tenant_ids=[job.tenant_id], gpu_class_id=gpu_class.pk)[job.tenant_id]
    assert usage == pytest.approx(4.0, rel=0.01), "each shard's estimate charged once"
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING


def test_a_merge_finds_the_job_merged_by_another_process_whose_lease_was_lost_and_stays_out(
    gpu_class: Any, tmp_path: Path
) -> None:
    # Redis restarted empty under a running merge: its lease is gone, and the sweep of another control
    # process sends the merge again.
    job, output = _finished_one_shard_job(tmp_path, gpu_class)
    _settle(Job.objects.select_related("model").get(pk=job.pk), list(job.shards.all()))
    merging, done = threading.Event(), threading.Event()

    def other_merge() -> None:
        try:
            with held_unless_taken(MERGE_LOCK.format(job_id=job.pk)) as held:
                assert held
                merging.set()
                done.wait(10)
        finally:
            connection.close()

    other = threading.Thread(target=other_merge)
    other.start()
    merging.wait(10)
    try:
        job_merge(job_id=str(job.pk), worker="second")
        second = Job.objects.get(pk=job.pk)
    finally:
        done.set()
        other.join()

    assert second.status == JobStatus.RUNNING, "the second merge stayed out"
    assert not (tmp_path / "output.jsonl").exists()
    job_merge(job_id=str(job.pk), worker="after")
    assert Job.objects.get(pk=job.pk).status == JobStatus.SUCCEEDED
    assert (tmp_path / "output.jsonl").read_bytes() == output
