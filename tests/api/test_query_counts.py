"""The job endpoints pollers hit most make a fixed number of database queries, however many jobs
the tenant has and in whatever state: no query per job listed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.jobs.models import Job, JobStatus
from tests.api.conftest import Caller
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db

# Key, membership, the page (or the job); the key's `last_used_at` write is once a minute, not per request.
MOST_QUERIES = 4


def _jobs(caller: Caller, count: int) -> list[Job]:
    model = ModelFactory(name="counted", is_default=False)
    statuses = [JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.QUEUED, JobStatus.FAILED]
    return Job.objects.bulk_create(
        Job(
            tenant=caller.tenant,
            model=model,
            status=statuses[n % len(statuses)],
            input_uri=f"file:///in/{n}.jsonl",
            output_uri=f"file:///out/{n}/output.jsonl",
            total_records=10,
            shard_count=1,
        )
        for n in range(count)
    )


def _queries(client: Any, path: str) -> int:
    client.get(path)  # the first request of a key records its use
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content
    return len(captured.captured_queries)


def test_the_job_list_makes_the_same_few_queries_for_3_or_60_jobs(caller: Callable[..., Caller]) -> None:
    few, many = caller("few"), caller("many")
    _jobs(few, 3)
    _jobs(many, 60)

    assert _queries(few.client, "/api/v1/jobs/") == _queries(many.client, "/api/v1/jobs/") <= MOST_QUERIES
    assert _queries(many.client, "/api/v1/jobs/?limit=200") <= MOST_QUERIES


def test_a_jobs_status_takes_a_fixed_few_queries(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    running, ended = _jobs(alice, 2)

    assert _queries(alice.client, f"/api/v1/jobs/{running.pk}/") <= MOST_QUERIES
    assert _queries(alice.client, f"/api/v1/jobs/{ended.pk}/") <= MOST_QUERIES
