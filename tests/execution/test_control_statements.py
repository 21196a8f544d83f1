"""What the control plane asks of PostgreSQL per small job stays a few statements: a one-record job's
every hop (plan, tick, settle, merge, ending) is on its latency's path, at about a millisecond a statement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.execution.endings import merge_when_settled
from portal.execution.scheduler import schedule_queue
from portal.execution.settle import shards_record_success
from portal.jobs.models import Job, JobStatus, JobUsage, Shard, ShardStatus
from portal.jobs.requests import JobRequest
from portal.jobs.transitions import job_transition
from tasks.shared.config import gpu_queue
from tasks.shared.specs import ShardManifest
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _job(gpu_class: Any, root: Path, *, status: str, shard_statuses: list[str]) -> Job:
    model = ModelFactory(name="statements", gpu_class=gpu_class, is_default=False)
    job = Job.objects.create(
        tenant=TenantFactory(name="counted"),
        model=model,
        status=status,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        shard_size=1,
        total_records=len(shard_statuses),
    )
    for index, shard_status in enumerate(shard_statuses):
        Shard.objects.create(
            job=job,
            index=index,
            first_record=index,
            record_count=1,
            input_uri=(root / f"{index}.jsonl").as_uri(),
            prefix_uri=(root / f"shard-{index}").as_uri(),
            status=shard_status,
            succeeded_records=1,
            compute_seconds=0.5,
            started_at=timezone.now(),
        )
    return job


def _statements(run: Any) -> tuple[Any, list[str]]:
    with CaptureQueriesContext(connection) as captured:
        result = run()
    return result, [query["sql"] for query in captured.captured_queries]


def test_a_tick_with_no_shard_waiting_or_running_anywhere_reads_once_and_locks_nothing(
    gpu_class: Any, tmp_path: Path
) -> None:
    # The tick after a small job's last shard settled: nothing to send, nothing to copy.
    _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=[ShardStatus.SUCCEEDED])
    sent, statements = _statements(lambda: schedule_queue(gpu_queue(gpu_class.name)))
    assert sent == 0
    assert len(statements) == 1, statements
    assert "pg_advisory_xact_lock" not in statements[0]


def test_a_tick_with_a_shard_waiting_still_sends_it(gpu_class: Any, tmp_path: Path) -> None:
    job = _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=[ShardStatus.PENDING])
    assert schedule_queue(gpu_queue(gpu_class.name)) == 1
    assert job.shards.get().status == ShardStatus.DISPATCHED


def test_a_tick_whose_window_is_full_reads_no_job(gpu_class: Any, tmp_path: Path, settings: Any) -> None:
    # A busy queue: its window (two places, no heartbeat known) holds two shards; a third waits.
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 2
    statuses = [ShardStatus.DISPATCHED, ShardStatus.DISPATCHED, ShardStatus.PENDING]
    job = _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=statuses)
    Shard.objects.filter(job=job).update(estimated_seconds=30.0)
    sent, statements = _statements(lambda: schedule_queue(gpu_queue(gpu_class.name)))
    assert sent == 0
    assert not [sql for sql in statements if sql.startswith('SELECT "jobs_job"')], statements
    # Nothing-to-send, BEGIN, the lock, the shards in flight with whether a long shard waits, COMMIT: no
    # statement grows with the shards waiting.
    assert len(statements) == 5, statements

    # A place frees: the same tick reads the jobs and sends the shard.
    Shard.objects.filter(job=job, index=0).update(status=ShardStatus.SUCCEEDED)
    assert schedule_queue(gpu_queue(gpu_class.name)) == 1
    assert job.shards.get(index=2).status == ShardStatus.DISPATCHED


def test_whether_a_job_merges_is_read_in_one_statement(gpu_class: Any, tmp_path: Path) -> None:
    job = _job(
        gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=[ShardStatus.SUCCEEDED, ShardStatus.DISPATCHED]
    )
    merged, statements = _statements(lambda: merge_when_settled(job))
    assert merged is False, "a shard still runs"
    assert len(statements) == 1, statements


def test_an_ending_writes_its_ledger_line_and_all_its_metric_samples_in_one_statement_each(
    gpu_class: Any, tmp_path: Path
) -> None:
    job = _job(gpu_class, tmp_path, status=JobStatus.MERGING, shard_statuses=[ShardStatus.SUCCEEDED] * 2)
    moved, statements = _statements(
        lambda: job_transition(
            job_id=str(job.pk),
            source=JobStatus.MERGING,
            target=JobStatus.SUCCEEDED,
            succeeded_records=2,
            finished_at=timezone.now(),
        )
    )
    assert moved
    assert JobUsage.objects.get(job=job).gpu_seconds == pytest.approx(1.0)
    # Up to its commit: the receivers of `job_ended` (webhooks, batches) run after it.
    ending = statements[: statements.index("COMMIT") + 1]
    ledger = [sql for sql in ending if "jobs_jobusage" in sql and not sql.startswith("SELECT")]
    samples = [sql for sql in ending if "ops_metricsample" in sql]
    assert len(ledger) == 1 and ledger[0].startswith("INSERT") and "ON CONFLICT" in ledger[0]
    assert len(samples) == 1, "the ending's counters, histograms and GPU-seconds in one write"
    assert not [sql for sql in ending if sql.startswith("SAVEPOINT")]
    # BEGIN, the move and its event, the job read once, what it charged before, its shards' sums, its
    # round's outcomes and first start (one read), the model's prices (the line's cost is kept on it), the
    # ledger line, the samples, COMMIT.
    assert len(ending) == 11, ending


def test_a_tick_that_sends_one_shard_reads_that_shard_once(gpu_class: Any, tmp_path: Path) -> None:
    statuses = [ShardStatus.PENDING, ShardStatus.DISPATCHED, ShardStatus.PENDING]
    job = _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=statuses)
    sent, statements = _statements(lambda: schedule_queue(gpu_queue(gpu_class.name)))
    assert sent == 2
    shard_reads = [sql for sql in statements if sql.startswith('SELECT "jobs_shard"."id"')]
    assert len(shard_reads) == 2, "the first waiting shard for its estimate, then the two to send"

    Shard.objects.filter(job=job).update(status=ShardStatus.SUCCEEDED)
    Shard.objects.filter(job=job, index=0).update(status=ShardStatus.PENDING)
    sent, statements = _statements(lambda: schedule_queue(gpu_queue(gpu_class.name)))
    assert sent == 1
    shard_reads = [sql for sql in statements if sql.startswith('SELECT "jobs_shard"."id"')]
    assert len(shard_reads) == 1, "the one shard sent is the one read for its estimate"
    assert job.shards.get(index=0).status == ShardStatus.DISPATCHED


def test_the_planner_of_a_job_planned_for_the_first_time_does_not_look_for_earlier_shards(
    gpu_class: Any, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    from portal.execution.plan import job_plan
    from portal.jobs.services.submit import job_submit

    ModelFactory(name="statements", gpu_class=gpu_class, is_default=False)
    path = tmp_path / "in.jsonl"
    path.write_text('{"custom_id": "a", "input": "one record"}\n')
    job = job_submit(
        tenant=TenantFactory(name="fresh"), request=JobRequest(model_name="statements", input_uri=str(path))
    )
    with django_capture_on_commit_callbacks():
        _, statements = _statements(lambda: job_plan(job_id=str(job.id)))
    job.refresh_from_db()
    assert (job.status, job.shard_count) == (JobStatus.RUNNING, 1)
    assert not [sql for sql in statements if 'SUM("jobs_shard"."record_count")' in sql]


def test_a_small_job_merged_where_its_last_shard_settles_asks_for_its_tenants_endpoints_once(
    gpu_class: Any, tmp_path: Path
) -> None:
    from bench.reconcile import write_commit
    from portal.execution.endings import endings_settle

    job = _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=[ShardStatus.DISPATCHED])
    Job.objects.filter(pk=job.pk).update(errors_uri=(tmp_path / "errors.jsonl").as_uri())
    shard = job.shards.get()
    write_commit(shard)
    Path(shard.prefix_uri.removeprefix("file://")).joinpath("out.jsonl").write_text('{"custom_id": "a"}\n')
    Path(shard.prefix_uri.removeprefix("file://")).joinpath("errors.jsonl").write_text("")

    _, statements = _statements(lambda: endings_settle([(str(job.pk), 0)]))

    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED
    endpoint_reads = [sql for sql in statements if 'FROM "webhooks_webhookendpoint"' in sql]
    assert len(endpoint_reads) == 1, "the ending's event alone: a job that merged sends no progress event"


def _manifest(shard: Shard, index: int) -> ShardManifest:
    return ShardManifest(
        job_id=str(shard.job_id),
        shard_index=shard.index,
        attempt_id=f"attempt-{index}",
        worker=f"host-{index}",
        pid=100 + index,
        output_uri=f"{shard.prefix_uri}/out-{index}.jsonl",
        errors_uri=f"{shard.prefix_uri}/errors-{index}.jsonl" if index % 2 else "",
        records=1,
        succeeded=index % 2 == 0,
        failed=index % 2,
        started_at=1_700_000_000.0 + index,
        finished_at=1_700_000_000.5 + index,
        compute_seconds=0.25 * (index + 1),
        load_seconds=0.125 * index,
        cache_hit=index != 2,
        model_loads=1,
        prompt_tokens=10 * index,
        completion_tokens=3 * index,
        error_codes={"input_too_long": 1} if index % 2 else {},
    )


def test_a_batch_of_committed_shards_is_written_in_one_statement_each_row_with_its_own_attempt(
    gpu_class: Any, tmp_path: Path
) -> None:
    job = _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=[ShardStatus.DISPATCHED] * 4)
    shards = list(job.shards.order_by("index"))
    committed = [(shard, _manifest(shard, shard.index)) for shard in shards]

    settled, statements = _statements(lambda: shards_record_success(committed))

    assert [shard.index for shard, _ in settled] == [0, 1, 2, 3]
    assert len([sql for sql in statements if sql.startswith('UPDATE "jobs_shard"')]) == 1, statements
    for shard, manifest in committed:
        row = Shard.objects.get(pk=shard.pk)
        assert (row.status, row.attempt_id, row.output_uri, row.errors_uri) == (
            ShardStatus.SUCCEEDED,
            manifest.attempt_id,
            manifest.output_uri,
            manifest.errors_uri,
        )
        assert (row.succeeded_records, row.failed_records, row.prompt_tokens, row.completion_tokens) == (
            manifest.succeeded,
            manifest.failed,
            manifest.prompt_tokens,
            manifest.completion_tokens,
        )
        assert (row.worker, row.worker_pid, row.cache_hit, row.error_codes) == (
            manifest.worker,
            manifest.pid,
            manifest.cache_hit,
            manifest.error_codes,
        )
        assert row.started_at is not None and row.started_at.timestamp() == manifest.started_at
        assert row.finished_at is not None and row.finished_at.timestamp() == manifest.finished_at
        assert (row.compute_seconds, row.load_seconds) == (manifest.compute_seconds, manifest.load_seconds)


def test_a_committed_attempt_already_recorded_is_not_settled_twice_and_another_attempt_is(
    gpu_class: Any, tmp_path: Path
) -> None:
    job = _job(gpu_class, tmp_path, status=JobStatus.RUNNING, shard_statuses=[ShardStatus.DISPATCHED] * 3)
    shards = list(job.shards.order_by("index"))
    shards_record_success([(shards[0], _manifest(shards[0], 0)), (shards[1], _manifest(shards[1], 1))])

    # As read before the first settling (a callback and the reconciler's sweep): shard 0 again with the
    # attempt its row records, shard 1 with another attempt (the row keeps what it holds), shard 2 new.
    again = [
        (shards[0], _manifest(shards[0], 0)),
        (shards[1], _manifest(shards[1], 7)),
        (shards[2], _manifest(shards[2], 2)),
    ]
    settled = shards_record_success(again)

    assert [shard.index for shard, _ in settled] == [1, 2]
    assert Shard.objects.get(pk=shards[0].pk).attempt_id == "attempt-0"


def _running_jobs(gpu_class: Any, root: Path, count: int) -> list[Job]:
    """`count` running jobs of one tenant, each with two shards sent: a long one and one that ends."""
    model = ModelFactory(name="settle-batch", gpu_class=gpu_class, is_default=False)
    tenant = TenantFactory(name="batched")
    jobs = []
    for number in range(count):
        job = Job.objects.create(
            tenant=tenant,
            model=model,
            status=JobStatus.RUNNING,
            input_uri="file:///x.jsonl",
            output_uri=(root / f"job-{number}" / "output.jsonl").as_uri(),
            shard_size=1,
        )
        for index in range(2):
            prefix = root / f"job-{number}" / f"shard-{index}"
            prefix.mkdir(parents=True)
            Shard.objects.create(
                job=job,
                index=index,
                first_record=index,
                record_count=1,
                input_uri=(prefix / "input.jsonl").as_uri(),
                prefix_uri=prefix.as_uri(),
                status=ShardStatus.DISPATCHED,
                task_id=f"shard-{job.pk}-{index}-t",
            )
        jobs.append(job)
    return jobs


def test_endings_of_many_jobs_read_and_write_their_shards_in_one_statement_each(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    from bench.reconcile import write_commit
    from portal.execution.endings import ShardEnding, endings_settle

    settings.BATCHERY_SPECULATION = False
    jobs = _running_jobs(gpu_class, tmp_path, 5)
    for job in jobs:
        write_commit(job.shards.get(index=0))

    _, statements = _statements(lambda: endings_settle([ShardEnding(str(job.pk), 0) for job in jobs]))

    assert all(job.shards.get(index=0).status == ShardStatus.SUCCEEDED for job in jobs)
    reads = [sql for sql in statements if sql.startswith('SELECT "jobs_shard"') and '"jobs_shard"."index" IN' in sql]
    writes = [sql for sql in statements if sql.startswith('UPDATE "jobs_shard"') and "FROM (VALUES" in sql]
    assert (len(reads), len(writes)) == (1, 1), statements


def test_a_shard_whose_commit_the_database_refuses_leaves_the_other_jobs_endings_settled(
    gpu_class: Any, tmp_path: Path, settings: Any
) -> None:
    from bench.reconcile import write_commit
    from portal.execution.endings import ShardEnding, endings_settle

    settings.BATCHERY_SPECULATION = False
    good, bad, other = _running_jobs(gpu_class, tmp_path, 3)
    write_commit(good.shards.get(index=0))
    write_commit(bad.shards.get(index=0), pid=2**40)  # more than the column holds
    write_commit(other.shards.get(index=0))

    endings_settle([ShardEnding(str(job.pk), 0) for job in (good, bad, other)])

    assert good.shards.get(index=0).status == ShardStatus.SUCCEEDED
    assert other.shards.get(index=0).status == ShardStatus.SUCCEEDED
    assert bad.shards.get(index=0).status == ShardStatus.DISPATCHED, "left to the reconciler's sweep"
