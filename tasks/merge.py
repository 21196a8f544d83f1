"""The chord callback (and its error callback): merge committed shard outputs and end the job."""

from __future__ import annotations

from tasks.app import app
from tasks.control import ControlTask


@app.task(name="batchery.merge_job", base=ControlTask)
def merge_job(job_id: str) -> None:
    from portal.jobs.services.merge import job_merge

    job_merge(job_id=job_id)
