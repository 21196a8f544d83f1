"""Reads of jobs that pages, the API and the CLI share."""

from __future__ import annotations

from dataclasses import dataclass

from portal.jobs.models import Job
from tasks.progress import read_job_progress


@dataclass(frozen=True)
class JobProgress:
    status: str
    total: int | None
    """Records in the job, once known."""
    done: int
    """Records finished, succeeded or failed."""
    failed: int

    @property
    def fraction(self) -> float:
        if not self.total:
            return 0.0
        return min(1.0, self.done / self.total)


def job_progress(job: Job) -> JobProgress:
    """Live figures from Redis while the job runs; the database's once it has ended."""
    if job.is_finished:
        done = job.succeeded_records + job.failed_records
        return JobProgress(status=job.status, total=job.total_records, done=done, failed=job.failed_records)
    live = read_job_progress(str(job.id))
    return JobProgress(status=job.status, total=job.total_records, done=live.done, failed=live.failed)
