"""Settling stitches a running job's finished shards ahead at most once every ADVANCE_INTERVAL_S, through
a mark in the real Redis; other jobs are not held back by it."""

from __future__ import annotations

import uuid

from portal.execution.endings import ADVANCE_KEY, _advance_due
from portal.jobs.models import Job
from tasks.shared.redis_client import redis_client


def test_a_job_is_stitched_ahead_once_an_interval_and_again_once_it_passed() -> None:
    first, second = Job(id=uuid.uuid4()), Job(id=uuid.uuid4())
    try:
        assert _advance_due(first)
        assert not _advance_due(first), "a second ending within the interval stitches nothing"
        assert _advance_due(second), "another job's mark is its own"
        redis_client().delete(ADVANCE_KEY.format(job_id=first.id))  # the interval passed
        assert _advance_due(first)
    finally:
        redis_client().delete(*(ADVANCE_KEY.format(job_id=job.id) for job in (first, second)))
