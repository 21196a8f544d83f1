"""The callback of each shard's chord (and its error callback): settle the shard, refill its place, merge when done."""

from __future__ import annotations

from typing import Any

from tasks.app import app
from tasks.control import ControlTask


@app.task(name="batchery.shard_done", base=ControlTask, bind=True, fails_job_from=frozenset({"running"}))
def shard_done(self: Any, job_id: str, shard_index: int) -> None:
    from portal.jobs.services.scheduler import shard_finished

    shard_finished(job_id=job_id, shard_index=shard_index)
