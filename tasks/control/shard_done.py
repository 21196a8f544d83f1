"""The callback of each chord of shards (and its error callback): report the endings; settled in batches.

A failure of the batch it drained (`BatchNotSettled`) fails no job: the batch held other jobs'
endings too, and the reconciler's sweep settles whatever stays `dispatched`. A failure to settle its
own ending alone (Redis down) still fails its job once the retries are spent.
"""

from __future__ import annotations

from typing import Any

from celery.utils.time import get_exponential_backoff_interval

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import SHARDS_ENDED_TASK


@app.task(
    name=SHARDS_ENDED_TASK,
    base=ControlTask,
    bind=True,
    ignore_result=True,
    fails_job_from=frozenset({"running"}),
)
def shard_done(self: Any, job_id: str, shard_indexes: int | list[int], queue: str = "") -> None:
    from portal.execution.endings_inbox import BatchNotSettled, endings_report

    # One index: a chord of one shard, sent before chords held several (a message of an older release).
    indexes = [shard_indexes] if isinstance(shard_indexes, int) else shard_indexes
    try:
        endings_report(job_id=job_id, shard_indexes=indexes, queue=queue)
    except BatchNotSettled as exc:
        if not exc.transient:
            raise
        # The database restarts: drain again later, backing off as `autoretry_for` does for its own errors.
        countdown = get_exponential_backoff_interval(
            factor=int(self.retry_backoff),
            retries=self.request.retries,
            maximum=self.retry_backoff_max,
            full_jitter=True,
        )
        raise self.retry(exc=exc, countdown=countdown) from exc
