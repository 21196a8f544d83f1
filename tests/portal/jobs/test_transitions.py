from __future__ import annotations

from typing import Any

import pytest

from portal.jobs.models import Job, JobStatus
from portal.jobs.services.transitions import job_fail, job_transition


@pytest.fixture
def queued_job(acme: Any, minilm: Any) -> Job:
    return Job.objects.create(tenant=acme, model=minilm, input_uri="file:///x.jsonl", shard_size=10)


def test_the_allowed_path_of_a_job_is_queued_planning_running_merging_ending(queued_job: Job) -> None:
    for status in (JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.MERGING, JobStatus.SUCCEEDED):
        assert job_transition(job_id=str(queued_job.pk), target=status)
    queued_job.refresh_from_db()
    assert queued_job.status == JobStatus.SUCCEEDED


def test_a_transition_that_skips_a_step_is_refused_and_changes_nothing(queued_job: Job) -> None:
    assert not job_transition(job_id=str(queued_job.pk), target=JobStatus.MERGING)
    queued_job.refresh_from_db()
    assert queued_job.status == JobStatus.QUEUED


def test_an_ended_job_keeps_its_ending_when_a_late_failure_arrives(queued_job: Job) -> None:
    assert job_transition(job_id=str(queued_job.pk), target=JobStatus.CANCELLED)
    assert not job_fail(job_id=str(queued_job.pk), reason="too late")
    queued_job.refresh_from_db()
    assert (queued_job.status, queued_job.error) == (JobStatus.CANCELLED, "")


def test_only_one_of_two_racing_merges_moves_the_job(queued_job: Job) -> None:
    job_transition(job_id=str(queued_job.pk), target=JobStatus.PLANNING)
    job_transition(job_id=str(queued_job.pk), target=JobStatus.RUNNING)
    results = [job_transition(job_id=str(queued_job.pk), target=JobStatus.MERGING) for _ in range(2)]
    assert results == [True, False]


def test_every_final_status_has_no_way_out() -> None:
    for status in (JobStatus.SUCCEEDED, JobStatus.PARTIALLY_SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED):
        assert Job.TRANSITIONS[status] == frozenset()
