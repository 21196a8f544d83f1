"""The callback of each shard's chord (and its error callback): report the ending; settled in batches."""

from __future__ import annotations

from typing import Any

from tasks.app import app
from tasks.control import ControlTask


@app.task(
    name="batchery.shard_done",
    base=ControlTask,
    bind=True,
    ignore_result=True,
    fails_job_from=frozenset({"running"}),
)
def shard_done(self: Any, job_id: str, shard_index: int, queue: str = "") -> None:
    from portal.jobs.services.finished_inbox import shard_finished_report

    shard_finished_report(job_id=job_id, shard_index=shard_index, queue=queue)
