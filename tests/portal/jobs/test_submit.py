from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Quota

BAD_LINES = [
    json.dumps({"custom_id": "a", "input": "a fine sentence"}),
    "this is not json",
    '["an", "array"]',
    json.dumps({"custom_id": "a", "input": "the same id again"}),
    json.dumps({"custom_id": "c", "text": "the wrong field"}),
]


def test_a_valid_input_becomes_a_queued_job_and_planning_is_enqueued_after_commit(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path], django_capture_on_commit_callbacks: Any
) -> None:
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(10)])
    with django_capture_on_commit_callbacks() as callbacks:
        job = job_submit(
            tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=4)
        )
    assert job.status == JobStatus.QUEUED
    assert job.total_records == 10
    assert job.input_uri == path.as_uri()
    assert job.output_uri.endswith(f"/jobs/{job.id}/output.jsonl")
    assert len(callbacks) == 1


def test_malformed_lines_are_refused_naming_every_line_and_no_job_is_created(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl(BAD_LINES)
    with pytest.raises(SubmissionError) as refused:
        job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    error = refused.value
    assert error.field == "input"
    assert [problem.line for problem in error.problems] == [2, 3, 4, 5]
    assert "line 2: not valid JSON" in error.message
    assert "line 3: expected a JSON object, got list" in error.message
    assert "line 4: duplicate custom_id 'a' (first on line 1)" in error.message
    assert "line 5: missing field 'input'" in error.message
    assert not Job.objects.exists()


def test_a_large_input_checked_by_the_planner_fails_the_job_with_the_lines_named_and_no_shard(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path], settings: Any
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    path = write_jsonl(BAD_LINES)
    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    assert job.total_records is None

    job_plan(job_id=str(job.id))

    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert job.error.startswith("input rejected: 4 bad lines: line 2: not valid JSON")
    assert "line 4: duplicate custom_id 'a' (first on line 1)" in job.error
    assert "line 5: missing field 'input'" in job.error
    assert not Shard.objects.filter(job=job).exists()


def test_planning_cuts_contiguous_shards_in_input_order(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path], django_capture_on_commit_callbacks: Any
) -> None:
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(10)])
    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=4))
    with django_capture_on_commit_callbacks() as dispatches:
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING
    assert (job.total_records, job.shard_count) == (10, 3)
    shards = list(job.shards.order_by("index"))
    assert [(s.first_record, s.record_count) for s in shards] == [(0, 4), (4, 4), (8, 2)]
    first_shard = Path(shards[0].input_uri.removeprefix("file://")).read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in first_shard] == ["r0", "r1", "r2", "r3"]
    # The scheduler is asked once when the first shard is written, once when planning ends.
    assert len(dispatches) == 2


def test_a_second_planning_message_for_the_same_job_does_nothing(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path], django_capture_on_commit_callbacks: Any
) -> None:
    path = write_jsonl([{"input": "one"}, {"input": "two"}])
    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
        job_plan(job_id=str(job.id))
    assert Shard.objects.filter(job=job).count() == 1


def test_an_unknown_model_is_refused_naming_the_known_ones(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"input": "x"}])
    with pytest.raises(
        SubmissionError, match="no enabled model or adapter named 'gpt-9'; models available: all-MiniLM-L6-v2"
    ):
        job_submit(tenant=acme, request=JobRequest(model_name="gpt-9", input_uri=str(path)))


def test_a_missing_input_file_is_refused(acme: Any, minilm: Any, tmp_path: Path) -> None:
    with pytest.raises(SubmissionError, match="cannot read the input: no such object") as refused:
        job_submit(
            tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(tmp_path / "nope.jsonl"))
        )
    assert refused.value.field == "input"


def test_the_concurrent_jobs_quota_refuses_a_job_over_the_limit(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    Quota.objects.filter(tenant=acme).update(max_concurrent_jobs=1)
    path = write_jsonl([{"input": "x"}])
    job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    with pytest.raises(QuotaExceeded) as refused:
        job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    assert (refused.value.quota, refused.value.limit, refused.value.current) == ("max_concurrent_jobs", 1, 1)


def test_an_omitted_shard_size_stays_empty_so_that_the_planner_cuts_by_cost(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"input": "x"}])
    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    job.refresh_from_db()
    assert job.shard_size is None
