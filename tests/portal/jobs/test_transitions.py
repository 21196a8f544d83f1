from __future__ import annotations

from typing import Any

import pytest

from portal.jobs.models import Job, JobStatus
from portal.jobs.transitions import job_fail, job_transition


@pytest.fixture
def queued_job(acme: Any, minilm: Any) -> Job:
    return Job.objects.create(tenant=acme, model=minilm, input_uri="file:///x.jsonl", shard_size=10)


def _walk(job: Job, *statuses: str) -> None:
    current = job.status
    for status in statuses:
        assert job_transition(job_id=str(job.pk), source=current, target=status)
        current = status


def test_the_allowed_path_of_a_job_is_queued_planning_running_merging_ending(queued_job: Job) -> None:
    _walk(queued_job, JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.MERGING, JobStatus.SUCCEEDED)
    queued_job.refresh_from_db()
    assert queued_job.status == JobStatus.SUCCEEDED


def test_an_edge_the_state_machine_does_not_have_is_a_programming_error(queued_job: Job) -> None:
    with pytest.raises(ValueError, match="a job may not go from queued to merging"):
        job_transition(job_id=str(queued_job.pk), source=JobStatus.QUEUED, target=JobStatus.MERGING)


def test_a_transition_from_a_status_the_job_is_not_in_changes_nothing(queued_job: Job) -> None:
    assert not job_transition(job_id=str(queued_job.pk), source=JobStatus.RUNNING, target=JobStatus.MERGING)
    queued_job.refresh_from_db()
    assert queued_job.status == JobStatus.QUEUED


def test_an_ended_job_keeps_its_ending_when_a_late_failure_arrives(queued_job: Job) -> None:
    assert job_transition(job_id=str(queued_job.pk), source=JobStatus.QUEUED, target=JobStatus.CANCELLED)
    assert not job_fail(job_id=str(queued_job.pk), reason="too late")
    queued_job.refresh_from_db()
    assert (queued_job.status, queued_job.error) == (JobStatus.CANCELLED, "")


def test_only_one_of_two_racing_merges_moves_the_job(queued_job: Job) -> None:
    _walk(queued_job, JobStatus.PLANNING, JobStatus.RUNNING)
    results = [
        job_transition(job_id=str(queued_job.pk), source=JobStatus.RUNNING, target=JobStatus.MERGING) for _ in range(2)
    ]
    assert results == [True, False]


def test_a_succeeded_or_cancelled_job_has_no_way_out_and_other_endings_lead_only_to_a_retry() -> None:
    for status in (JobStatus.SUCCEEDED, JobStatus.CANCELLED):
        assert Job.TRANSITIONS[status] == frozenset()
    for status in (JobStatus.PARTIALLY_SUCCEEDED, JobStatus.FAILED, JobStatus.EXPIRED):
        assert Job.TRANSITIONS[status] == frozenset({JobStatus.PLANNING})
