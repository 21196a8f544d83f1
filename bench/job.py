"""One job through the stack, timed from its submission to its end as its row records it.

The benchmarks' whole-stack rates come from here. The end is the job's `finished_at` (its merged
output published), not the moment a poll saw it: so the poll can be slow, and the measuring process
takes next to nothing from the cores the stack is measured on (a progress bar redrawn ten times a
second and a query every 0.2 s did).
"""

from __future__ import annotations

import time
from pathlib import Path

from django.utils import timezone

from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Tenant

POLL_S = 1.0


def timed_job(
    *,
    tenant: Tenant,
    model_name: str,
    dataset: Path,
    shard_size: int | None = None,
    timeout_s: float = 3600,
    poll_s: float = POLL_S,
) -> tuple[Job, float]:
    """Submit `dataset`, wait for the job's end; return it with its seconds from submission to end."""
    submitted = timezone.now()
    job = job_submit(
        tenant=tenant, request=JobRequest(model_name=model_name, input_uri=str(dataset), shard_size=shard_size)
    )
    deadline = time.monotonic() + timeout_s
    while not job.is_finished:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.id} still {job.status} after {timeout_s:.0f} s")
        time.sleep(poll_s)
        job.refresh_from_db()
    assert job.finished_at is not None
    return job, (job.finished_at - submitted).total_seconds()
