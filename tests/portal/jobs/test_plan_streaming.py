"""Streaming planning, the planner alone: shard rows appear as their inputs are written, a bad line
found after shards were written still refuses the input naming every bad line and publishes
nothing, and a planner that died is resumed after the shards it created. With real workers:
`tests/execution/test_streaming_plan_e2e.py`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.execution import plan
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Quota, Tenant
from tasks.shared.stops import stop_reason
from tasks.shared.storage import store_for


def _records(count: int) -> list[Any]:
    return [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(count)]


def _planner_checked(acme: Tenant, path: Path, settings: Any, *, shard_size: int) -> Job:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0  # as for an input too large to check at submission
    return job_submit(
        tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=shard_size)
    )


def test_each_shard_row_is_created_while_the_job_is_still_planning(
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setattr(plan, "ROWS_WAIT_S", 0.0)  # no burst waits: each row is inserted as it is written
    job = _planner_checked(acme, write_jsonl(_records(10)), settings, shard_size=2)
    seen: list[tuple[str, int]] = []
    written = plan.StreamingDispatch.shard_written

    def spy(self: plan.StreamingDispatch, planned: plan.PlannedShard) -> None:
        written(self, planned)
        seen.append((Job.objects.get(pk=job.pk).status, Shard.objects.filter(job=job).count()))

    monkeypatch.setattr(plan.StreamingDispatch, "shard_written", spy)
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    assert seen == [(JobStatus.PLANNING, n) for n in range(1, 6)]
    job.refresh_from_db()
    assert (job.status, job.total_records, job.shard_count) == (JobStatus.RUNNING, 10, 5)


def _shard_inserts(queries: CaptureQueriesContext) -> int:
    insert = f'INSERT INTO "{Shard._meta.db_table}"'
    return sum(1 for query in queries.captured_queries if query["sql"].startswith(insert))


def test_the_rows_of_a_burst_of_shards_wait_to_be_inserted_together_and_never_past_the_planners_end(
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setattr(plan, "ROWS_WAIT_S", 3600.0)  # every shard after the first comes "in a burst"
    monkeypatch.setattr(plan, "SCHEDULE_EVERY_S", 3600.0)
    job = _planner_checked(acme, write_jsonl(_records(10)), settings, shard_size=2)
    seen: list[int] = []
    written = plan.StreamingDispatch.shard_written

    def spy(self: plan.StreamingDispatch, planned: plan.PlannedShard) -> None:
        written(self, planned)
        seen.append(Shard.objects.filter(job=job).count())

    monkeypatch.setattr(plan.StreamingDispatch, "shard_written", spy)
    with django_capture_on_commit_callbacks(), CaptureQueriesContext(connection) as queries:
        job_plan(job_id=str(job.id))

    # The first shard's row at once (the scheduler sends it while planning goes on); the other four in
    # one statement when the input has been read.
    assert seen == [1, 1, 1, 1, 1]
    assert _shard_inserts(queries) == 2
    job.refresh_from_db()
    assert (job.status, job.shard_count) == (JobStatus.RUNNING, 5)
    assert [(s.index, s.first_record, s.record_count) for s in job.shards.order_by("index")] == [
        (n, 2 * n, 2) for n in range(5)
    ]


def test_waiting_rows_are_inserted_before_each_scheduler_tick_and_once_they_waited_past_their_time(
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setattr(plan, "ROWS_WAIT_S", 3600.0)
    job = _planner_checked(acme, write_jsonl(_records(10)), settings, shard_size=2)
    dispatch = plan.StreamingDispatch(job)
    ticks: list[int] = []
    monkeypatch.setattr(plan, "schedule_job", lambda job_id: ticks.append(Shard.objects.filter(job=job).count()))

    def shard(index: int) -> plan.PlannedShard:
        return plan.PlannedShard(index=index, first_record=2 * index, record_count=2, input_uri=f"file:///in/{index}")

    with django_capture_on_commit_callbacks(execute=True):
        dispatch.shard_written(shard(0))
        dispatch.shard_written(shard(1))
    assert (ticks, Shard.objects.filter(job=job).count()) == ([1], 1)

    monkeypatch.setattr(plan, "SCHEDULE_EVERY_S", 0.0)  # the next shard is the scheduler's time again
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.shard_written(shard(2))
    assert ticks == [1, 3]

    monkeypatch.setattr(plan, "SCHEDULE_EVERY_S", 3600.0)
    dispatch.shard_written(shard(3))
    dispatch.records_read()
    assert Shard.objects.filter(job=job).count() == 3
    monkeypatch.setattr(plan, "ROWS_WAIT_S", 0.0)  # a large shard being written: the row has waited long enough
    dispatch.records_read()
    assert Shard.objects.filter(job=job).count() == 4


def test_a_bad_line_found_after_shards_were_written_refuses_the_input_naming_every_bad_line_and_publishes_nothing(
    acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path], settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    lines: list[Any] = _records(20)
    lines[8] = "not json"
    lines[12] = {"custom_id": "x", "text": "the wrong field"}
    lines[19] = {"custom_id": "r0", "input": "the first id again"}
    job = _planner_checked(acme, write_jsonl(lines), settings, shard_size=2)

    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))

    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert job.error.startswith("input rejected: 3 bad lines: line 9: not valid JSON")
    assert "line 13: missing field 'input'" in job.error
    assert "line 20: duplicate custom_id 'r0' (first on line 1)" in job.error
    # Lines 1-6 were written as three shards before line 9 was read; the shard of lines 7-8 never got a row.
    shards = list(job.shards.order_by("index"))
    assert [(s.first_record, s.record_count) for s in shards] == [(0, 2), (2, 2), (4, 2)]
    assert not any(store_for(s.input_uri).exists(s.input_uri) for s in shards)
    # Shards already sent are told to stop; no merge, so no output and no error file.
    assert stop_reason(str(job.id)) == JobStatus.FAILED
    assert not store_for(job.output_uri).exists(job.output_uri)
    assert not store_for(job.errors_uri).exists(job.errors_uri)


def test_a_planner_that_died_is_resumed_after_the_shards_it_created(
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job = _planner_checked(acme, write_jsonl(_records(10)), settings, shard_size=4)
    written = plan.StreamingDispatch.shard_written

    def die_after_the_first(self: plan.StreamingDispatch, planned: plan.PlannedShard) -> None:
        if planned.index > 0:
            raise SystemExit("the planner's process died")
        written(self, planned)

    monkeypatch.setattr(plan.StreamingDispatch, "shard_written", die_after_the_first)
    with pytest.raises(SystemExit), django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    first = Shard.objects.get(job=job)
    assert Job.objects.get(pk=job.pk).status == JobStatus.PLANNING

    monkeypatch.setattr(plan.StreamingDispatch, "shard_written", written)
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))

    job.refresh_from_db()
    assert (job.status, job.total_records, job.shard_count) == (JobStatus.RUNNING, 10, 3)
    shards = list(job.shards.order_by("index"))
    assert [(s.first_record, s.record_count) for s in shards] == [(0, 4), (4, 4), (8, 2)]
    assert shards[0].pk == first.pk
    ids = [
        [json.loads(line)["custom_id"] for line in Path(s.input_uri.removeprefix("file://")).read_text().splitlines()]
        for s in shards
    ]
    assert ids == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"], ["r8", "r9"]]


def test_an_input_too_large_to_count_at_submission_is_held_to_the_tenants_queued_records_by_its_planner(
    acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path], settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    running = _planner_checked(acme, write_jsonl(_records(3), "running.jsonl"), settings, shard_size=2)
    Job.objects.filter(pk=running.pk).update(status=JobStatus.RUNNING, total_records=3)
    Quota.objects.filter(tenant=acme).update(max_queued_records=10)
    fits = _planner_checked(acme, write_jsonl(_records(7), "fits.jsonl"), settings, shard_size=2)
    too_many = _planner_checked(acme, write_jsonl(_records(12), "too-many.jsonl"), settings, shard_size=2)
    assert fits.total_records is None and too_many.total_records is None, "not counted at submission"

    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(fits.id))
    fits.refresh_from_db()
    assert (fits.status, fits.total_records) == (JobStatus.RUNNING, 7), fits.error

    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(too_many.id))
    too_many.refresh_from_db()
    assert too_many.status == JobStatus.FAILED
    # 3 + 7 queued already: its first record is one too many.
    assert too_many.error == "quota max_queued_records exceeded: limit 10, in use 10, this job needs at least 1"
    assert not too_many.shards.exists()
    assert stop_reason(str(too_many.id)) == JobStatus.FAILED
    assert not store_for(too_many.output_uri).exists(too_many.output_uri)


def test_the_planner_stops_a_job_whose_records_pass_the_quota_after_its_first_shards_ran(
    acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path], settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    Quota.objects.filter(tenant=acme).update(max_queued_records=5)
    job = _planner_checked(acme, write_jsonl(_records(9)), settings, shard_size=2)

    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))

    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert job.error == "quota max_queued_records exceeded: limit 5, in use 0, this job needs at least 6"
    shards = list(job.shards.order_by("index"))
    assert [(s.first_record, s.record_count) for s in shards] == [(0, 2), (2, 2)]
    assert not any(store_for(s.input_uri).exists(s.input_uri) for s in shards)
    assert stop_reason(str(job.id)) == JobStatus.FAILED
