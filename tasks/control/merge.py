"""`batchery.merge_job`: merge a job whose shards have settled and end it (`portal.execution.merge`),
or finalize a stopped job (`stop="cancelled"` or `"expired"`) without waiting for its shards. Sent by
the endings' settling, by a stop and by the reconciler; a second merge of the same job does nothing.
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
