"""Dispatch: a running job's pending shards become one Celery chord.

Each shard task goes to the queue of its model's GPU class and size; the chord's callback and its
error callback are both `merge_job`, so a shard that fails for good still ends the job.
"""

from __future__ import annotations

import logging
import uuid

from celery import chord, group
from django.db import transaction
from django.db.models import F

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from tasks.config import CONTROL_QUEUE, gpu_queue
from tasks.formats.records import input_field_for
from tasks.specs import ShardSpec

logger = logging.getLogger(__name__)


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


def job_dispatch(*, job_id: str) -> None:
    from tasks.merge import merge_job
    from tasks.run_shard import run_shard

    job = Job.objects.select_related("model__gpu_class").get(pk=job_id)
    if job.status != JobStatus.RUNNING:
        logger.info("job %s is %s; not dispatching", job_id, job.status)
        return
    shards = list(job.shards.filter(status=ShardStatus.PENDING).order_by("index"))
    if not shards:
        return
    queue = gpu_queue(job.model.gpu_class.name, job.model.gpus_per_replica)
    signatures = []
    # Rows first, one commit, then the messages: a crash in between leaves shards marked dispatched
    # that never commit, which can be found and sent again; the reverse would run shards the
    # database does not know were sent.
    with transaction.atomic():
        for shard in shards:
            task_id = f"shard-{job.id}-{shard.index}-{uuid.uuid4().hex[:12]}"
            claimed = Shard.objects.filter(pk=shard.pk, status=ShardStatus.PENDING).update(
                status=ShardStatus.DISPATCHED, task_id=task_id, attempt=F("attempt") + 1
            )
            if claimed:
                spec = shard_spec(job, shard).to_dict()
                signatures.append(run_shard.signature((spec,), task_id=task_id, queue=queue))
    if not signatures:
        return
    callback = merge_job.si(str(job.id)).set(queue=CONTROL_QUEUE)
    # Called instead of the callback when a shard fails for good, once every shard has returned.
    callback.on_error(merge_job.si(str(job.id)).set(queue=CONTROL_QUEUE))
    chord(group(signatures), callback).apply_async()
    logger.info("job %s dispatched: %d shards on %s", job_id, len(signatures), queue)
