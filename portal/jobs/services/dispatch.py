"""Dispatch: a running job's pending shards become one Celery chord.

Each shard task goes to the queue of its model's GPU class and size, with its tenant's priority and
with time limits derived from the model and the shard size; the chord's callback and its error
callback are both `merge_job`, so a shard that fails for good still ends the job. Shards whose
message was lost, or whose task was killed, are sent again the same way, each time with a new task id.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from celery import chord, group
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.ops.metrics.jobs import shards_redispatched_record
from tasks.config import CONTROL_QUEUE, SHARD_HARD_TIME_LIMIT_S, SHARD_MAX_DISPATCHES, gpu_queue, message_priority
from tasks.formats.records import input_field_for
from tasks.specs import ShardSpec

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_BASE_S = 120.0
DEFAULT_TIME_LIMIT_PER_RECORD_S = 1.0


def shard_spec(job: Job, shard: Shard) -> ShardSpec:
    return ShardSpec(
        job_id=str(job.id),
        shard_index=shard.index,
        record_count=shard.record_count,
        input_uri=shard.input_uri,
        shard_prefix=shard.prefix_uri,
        model=job.model.to_spec(),
        input_field=input_field_for(job.model.task),
        params={**job.model.default_params, **job.params},
    )


def shard_time_limits(job: Job, shard: Shard) -> tuple[float, float]:
    """(soft, hard) seconds: a base plus a cost per record, from the model's defaults, capped so
    that the broker's visibility timeout always outlasts the hard limit."""
    params = {**job.model.default_params, **job.params}
    base = float(params.get("time_limit_base_s", DEFAULT_TIME_LIMIT_BASE_S))
    per_record = float(params.get("time_limit_per_record_s", DEFAULT_TIME_LIMIT_PER_RECORD_S))
    hard = min(base + per_record * shard.record_count, float(SHARD_HARD_TIME_LIMIT_S))
    return hard * 0.9, hard


def job_dispatch(*, job_id: str) -> None:
    """Send every pending shard of a running job as one chord; a job without shards merges at once."""
    from tasks.merge import merge_job
    from tasks.run_shard import run_shard

    job = Job.objects.select_related("model__gpu_class", "tenant").get(pk=job_id)
    if job.status != JobStatus.RUNNING:
        logger.info("job %s is %s; not dispatching", job_id, job.status)
        return
    if not job.shards.exists():
        merge_job.apply_async((job_id,), queue=CONTROL_QUEUE)
        return
    shards = list(job.shards.filter(status=ShardStatus.PENDING).order_by("index"))
    queue = gpu_queue(job.model.gpu_class.name, job.model.gpus_per_replica)
    # A job may run below its tenant's priority (background work), never above it.
    priority = message_priority(job.tenant.priority if job.priority is None else min(job.priority, job.tenant.priority))
    signatures = []
    # Rows first, one commit, then the messages: a crash in between leaves shards marked dispatched
    # with no message, which the reconciler finds and sends again; the reverse would run shards the
    # database does not know were sent.
    with transaction.atomic():
        for shard in shards:
            task_id = f"shard-{job.id}-{shard.index}-{uuid.uuid4().hex[:12]}"
            claimed = Shard.objects.filter(pk=shard.pk, status=ShardStatus.PENDING).update(
                status=ShardStatus.DISPATCHED, task_id=task_id, attempt=F("attempt") + 1, dispatched_at=timezone.now()
            )
            if claimed:
                soft, hard = shard_time_limits(job, shard)
                signatures.append(
                    run_shard.signature(
                        (shard_spec(job, shard).to_dict(),),
                        task_id=task_id,
                        queue=queue,
                        priority=priority,
                        soft_time_limit=soft,
                        time_limit=hard,
                    )
                )
    if not signatures:
        return
    callback = merge_job.si(job_id).set(queue=CONTROL_QUEUE)
    # Called instead of the callback when a shard fails for good, once every shard has returned.
    callback.on_error(merge_job.si(job_id).set(queue=CONTROL_QUEUE))
    chord(group(signatures), callback).apply_async()
    logger.info("job %s dispatched: %d shards on %s", job_id, len(signatures), queue)


def job_redispatch(*, job_id: str, shards: Sequence[Shard], reason: str) -> int:
    """Send shards again whose message was lost or whose task was killed; return how many went.

    Each is put back to pending only if it still carries the task id it was last sent with, so two
    reconcilers cannot both send it. A shard sent too often fails for good instead.
    """
    resent = 0
    for shard in shards:
        if shard.attempt >= SHARD_MAX_DISPATCHES:
            Shard.objects.filter(pk=shard.pk, task_id=shard.task_id).update(
                status=ShardStatus.FAILED, error=f"sent {shard.attempt} times and never finished ({reason})"
            )
            continue
        resent += Shard.objects.filter(pk=shard.pk, status=ShardStatus.DISPATCHED, task_id=shard.task_id).update(
            status=ShardStatus.PENDING
        )
    if resent:
        logger.warning("job %s: sending %d shards again: %s", job_id, resent, reason)
        shards_redispatched_record(job=Job.objects.select_related("tenant", "model").get(pk=job_id), count=resent)
        job_dispatch(job_id=job_id)
    return resent
