"""Run a job in this process, without workers: plan, every shard through the slot's shard body
(`execute_shard`), settle and merge, as `tests/execution/test_prefix_grouping_merge.py` does. Fast enough
for a re-run and its comparison in a unit test."""

from __future__ import annotations

from typing import Any

from portal.execution.dispatch import shard_spec
from portal.execution.merge import job_merge
from portal.execution.plan import job_plan
from portal.execution.settle import shard_record_success
from portal.jobs.models import Job, JobStatus
from tasks.shared.specs import ShardManifest
from tasks.slot.shard_execution import execute_shard


def run_in_process(job: Job, captured: Any, *, merged: list[Any] | None = None) -> Job:
    """Run `job` to its ending; `captured` is pytest-django's `django_capture_on_commit_callbacks`, which
    holds back the messages planning and merging would send (those of the merge put in `merged`)."""
    with captured():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING, job.error
    for shard in job.shards.order_by("index"):
        manifest = execute_shard(shard_spec(job, shard), worker="w1")
        assert isinstance(manifest, ShardManifest)
        shard_record_success(shard, manifest)
    with captured() as callbacks:
        job_merge(job_id=str(job.id))
    if merged is not None:
        merged.extend(callbacks)
    job.refresh_from_db()
    return job


def edit_distance(a: str, b: str) -> int:
    """The textbook table, to check the report's bit-parallel one against."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]
