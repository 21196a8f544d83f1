"""The chord callback (and its error callback): merge committed shard outputs and end the job.

The same task finalizes a stopped job (`stop="cancelled"` or `"expired"`) without waiting for it.
"""

from __future__ import annotations

from typing import Any

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import MERGE_TASK


@app.task(
    name=MERGE_TASK,
    base=ControlTask,
    bind=True,
    fails_job_from=frozenset({"running", "merging", "cancelling"}),
)
def merge_job(self: Any, job_id: str, stop: str | None = None) -> None:
    from portal.execution.merge import job_merge

    job_merge(job_id=job_id, stop=stop, worker=f"{self.request.hostname}:{self.request.id}")
