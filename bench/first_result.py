"""First result (`make bench`): how long after submission a job's first records are done, on a warm
fleet, for a large input (2 GB by default: its planner has read a sliver of it by then).

The first result is the first shard's commit: from then its records count as done in the job's
progress and its output is stitched ahead of the merge. The job is cancelled once that is seen, so
the benchmark does not embed two gigabytes on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from portal.jobs.models import FINAL_STATUSES, Job, ShardStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.stop import job_cancel
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Tenant


@dataclass(frozen=True)
class FirstResult:
    input_bytes: int
    seconds: float
    """Submission to the first shard's commit, as the shard's row records it."""
    shard_records: int
    """Records of that first shard."""


def first_result(*, tenant: Tenant, model_name: str, path: Path, timeout_s: float = 120) -> FirstResult:
    """Submit `path`, wait for its first committed shard, cancel the job and wait for its end."""
    submitted = time.time()
    job = job_submit(tenant=tenant, request=JobRequest(model_name=model_name, input_uri=str(path)))
    deadline = time.monotonic() + timeout_s
    try:
        while (first := first_committed(job)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job.id}: no shard committed {timeout_s:.0f} s after submission")
            time.sleep(0.05)  # the time comes from the shard's row: polling less often only disturbs less
    finally:
        job_cancel(job=Job.objects.get(pk=job.pk))
        while Job.objects.get(pk=job.pk).status not in FINAL_STATUSES and time.monotonic() < deadline + 60:
            time.sleep(0.2)
    finished_at, records = first
    return FirstResult(input_bytes=path.stat().st_size, seconds=finished_at - submitted, shard_records=records)


def first_committed(job: Job) -> tuple[float, int] | None:
    """The first committed shard's end (a Unix time) and its records, once one has committed; else None."""
    shard = job.shards.filter(status=ShardStatus.SUCCEEDED).order_by("finished_at").first()
    if shard is None or shard.finished_at is None:
        return None
    return shard.finished_at.timestamp(), shard.record_count
