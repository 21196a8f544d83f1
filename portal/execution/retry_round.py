"""A retry round's cut, on the planning lane: the failed records of a job's last round, picked out of that
round's shard inputs and written as the new round's shards.

`portal.jobs.services.retry.job_retry` only records the retry (quota and budget held, the job `planning`
with its next round number) and sends the planning task, which comes here for a job whose round is past 0.
Memory stays bounded whatever the job's size: the error file and the last round's records are both in
input order (the merge writes errors in output order; a round is cut in input order from the one before,
and a prefix-grouped job's first round is merged back into it by its shards' positions), so the two are
walked side by side, each read once, and no set of failed ids is ever held.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator
from typing import Any

import orjson
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from portal.execution.endings import merge_when_settled
from portal.execution.merge_order import shard_positions
from portal.execution.scheduler import schedule_job
from portal.execution.shard_cut import ShardCut
from portal.execution.shard_writer import ShardWriter
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.storage_layout import job_root
from portal.jobs.transitions import job_transition
from tasks.shared.config import LEASE_TTL_S
from tasks.shared.formats.records import Record, input_field_for
from tasks.shared.stops import clear_stop
from tasks.shared.storage import store_for

logger = logging.getLogger(__name__)

BEAT_RECORDS = 4096
"""Records read between looks at the clock for the heartbeat."""
BEAT_EVERY_S = LEASE_TTL_S / 3


def _failed_ids(job: Job) -> Iterator[str]:
    """The custom_ids of the error file, in its order (the input's), one line held at a time."""
    with store_for(job.errors_uri).open_read(job.errors_uri) as errors:
        for line in errors:
            yield orjson.loads(line)["custom_id"]


class _Heartbeat:
    """Keeps the job's `updated_at` fresh while its round is cut, as the planner does, so that the reconciler
    does not take a live cut for a dead one when the plan lease was lost with Redis; False once the job left
    `planning` (cancelled meanwhile), and the cut stops."""

    def __init__(self, job_id: str) -> None:
        self._job_id = job_id
        self._records = 0
        self._at = time.monotonic()

    def __call__(self) -> bool:
        self._records += 1
        if self._records % BEAT_RECORDS or time.monotonic() - self._at < BEAT_EVERY_S:
            return True
        self._at = time.monotonic()
        return bool(Job.objects.filter(pk=self._job_id, status=JobStatus.PLANNING).update(updated_at=timezone.now()))


def _last_round_records(job: Job, round_: int) -> Iterator[dict[str, Any]]:
    """The records of the round before `round_` in input order: shard by shard in index order, but for the
    first round of a prefix-grouped job, whose shards interleave (merged by their positions)."""
    shards = job.shards.filter(round=round_ - 1)
    if round_ == 1 and job.prefix_groups:
        yield from _grouped_records(list(shards.order_by("first_record")))
        return
    for uri in shards.order_by("index").values_list("input_uri", flat=True):
        yield from _records(uri)


def _records(uri: str) -> Iterator[dict[str, Any]]:
    with store_for(uri).open_read(uri) as source:
        for raw in source:
            yield orjson.loads(raw)


def _grouped_records(shards: list[Shard]) -> Iterator[dict[str, Any]]:
    """A k-way merge of grouped shards' records by the positions written beside their inputs; a shard is opened
    only when the merge reaches its first record, as the merge does (`merge_order`)."""
    waiting = shards[::-1]
    heap: list[tuple[int, int, dict[str, Any], Iterator[tuple[int, dict[str, Any]]]]] = []

    def take(index: int, records: Iterator[tuple[int, dict[str, Any]]]) -> None:
        following = next(records, None)
        if following is not None:
            heapq.heappush(heap, (following[0], index, following[1], records))

    while waiting or heap:
        while waiting and (not heap or waiting[-1].first_record < heap[0][0]):
            shard = waiting.pop()
            take(shard.index, zip(shard_positions(shard), _records(shard.input_uri), strict=True))
        if not heap:
            continue  # an empty shard
        _position, index, record, records = heapq.heappop(heap)
        yield record
        take(index, records)


def retry_round_plan(job: Job) -> None:
    """Cut round `job.retry_round` of a job found `planning` for it, and set it running (a round whose records
    are all gone merges at once and ends as it was). A planner that died is replaced by one that cuts again:
    the rows are created with the move to `running`, all or none, and the shard files are overwritten."""
    job_id = str(job.id)
    round_ = job.retry_round
    root = job_root(job)
    first = (job.shards.exclude(round=round_).aggregate(last=Max("index"))["last"] or 0) + 1
    writer = ShardWriter(root, ShardCut.for_job(job), input_field=input_field_for(job.model.task), first_index=first)
    picked = unmatched = 0
    alive = _Heartbeat(job_id)
    try:
        records = _last_round_records(job, round_)
        for failed_id in _failed_ids(job):
            # Both in input order: skip the records that succeeded up to the next failed one.
            for data in records:
                if not alive():
                    writer.abort()
                    logger.info("job %s left planning while its retry round was cut", job_id)
                    return
                if data["custom_id"] == failed_id:
                    writer.add(Record(line=0, custom_id=failed_id, data=data))
                    picked += 1
                    break
            else:
                unmatched += 1
    except BaseException:
        writer.abort()
        raise
    planned = writer.close()
    if unmatched:
        logger.warning("job %s round %d: %d failed ids not found in the last round's inputs", job_id, round_, unmatched)
    clear_stop(job_id)
    with transaction.atomic():
        Shard.objects.bulk_create(shard.row(job_id=job_id, root=root, round_=round_) for shard in planned)
        if not job_transition(job_id=job_id, source=JobStatus.PLANNING, target=JobStatus.RUNNING):
            transaction.set_rollback(True)
            logger.info("job %s left planning while its retry round was cut", job_id)
            return
        transaction.on_commit(lambda: _round_planned(job_id))
    logger.info("job %s: retrying %d failed records in %d shards (round %d)", job_id, picked, len(planned), round_)


def _round_planned(job_id: str) -> None:
    schedule_job(job_id=job_id)
    merge_when_settled(Job.objects.select_related("model__gpu_class", "tenant").get(pk=job_id))
