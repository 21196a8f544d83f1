"""Planning: stream a queued job's input once, cut it into shards, write their inputs, create rows.

A job given a shard size is cut every that many records. Otherwise each shard ends before its
estimated compute seconds would pass BATCHERY_TARGET_SHARD_SECONDS, the estimate coming from the
model's learned throughput (`portal.catalog.throughput`), so a shard of long documents holds fewer
records than one of short ones and shards take about equally long. Either way each shard records
its input characters and estimate, for the scheduler to charge and to learn from.

Memory stays bounded whatever the input size: one record at a time is held, plus 8 bytes a record
for the duplicate-id check. A bad line stops shard writing (the check goes on to name every bad
line), and the job fails with those lines named; no shard is dispatched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import orjson
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.catalog.throughput import CostModel, throughput_estimate
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.services.dispatch import job_queue
from portal.jobs.services.storage_layout import job_root, shard_input_uri, shard_prefix
from portal.jobs.services.transitions import job_fail, job_transition
from portal.scheduling.capacity import queue_slots
from tasks.formats.inputs import InputOptions, InputOptionsError, find_duplicate_records, iter_records
from tasks.formats.jsonl import JsonlCheck, colliding_id_hashes
from tasks.formats.records import Record, input_field_for
from tasks.leases import Lease, LeaseHeld, job_lease_key
from tasks.storage import StorageError, join_uri, store_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedShard:
    index: int
    first_record: int
    record_count: int
    input_uri: str
    input_chars: int = 0
    estimated_seconds: float = 0.0


@dataclass(frozen=True)
class ShardCut:
    """Where the planner ends a shard."""

    cost: CostModel
    """Predicts a shard's compute seconds; recorded on every shard however it is cut."""
    shard_size: int | None = None
    """Records per shard, as submitted; None: cut by cost."""
    target_seconds: float = 60.0
    """Cutting by cost: a shard ends before its estimated seconds would pass this."""
    max_records: int = 10_000
    """Cutting by cost: a shard ends at this many records, whatever its estimate."""

    @classmethod
    def for_job(cls, job: Job) -> ShardCut:
        cost = throughput_estimate(job.model)
        target = float(settings.BATCHERY_TARGET_SHARD_SECONDS)
        if job.total_records:
            # Known at submission: two shards a slot at least, the input's bytes standing in for its characters.
            whole = cost.seconds(job.total_records, job.input_bytes)
            spread = 2 * queue_slots(job_queue(job))
            target = min(target, max(settings.BATCHERY_MIN_SHARD_SECONDS, whole / spread))
        return cls(
            cost=cost,
            shard_size=job.shard_size,
            target_seconds=target,
            max_records=settings.BATCHERY_MAX_SHARD_RECORDS,
        )

    def ends_before(self, *, records: int, seconds: float, next_seconds: float) -> bool:
        """Whether a shard holding `records` records estimated at `seconds` ends before the next one."""
        if self.shard_size is not None:
            return records >= self.shard_size
        # A record dearer than the target still gets a shard: it is never cut before its first. The
        # tolerance keeps 20 records of 0.05 s in a 1 s shard although their float sum is 1.0000000000000002.
        over = seconds + next_seconds > self.target_seconds * (1 + 1e-9)
        return records >= self.max_records or (records > 0 and over)


def input_chars(value: Any) -> int:
    """Characters of a record's input: a text, a list of texts, or chat messages (their contents,
    text parts only). What the throughput fit calls `chars`.

    Walked with a stack, not recursion: a message's content may be nested as deep as the JSON
    parser allowed."""
    chars = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.append(item["content"] if "content" in item else item.get("text"))
    return chars


@dataclass(frozen=True)
class CutShard:
    """A shard where the cut ends it, before anything is written."""

    first_record: int
    """Records before it, counted from where the cutting started."""
    record_count: int
    input_chars: int
    estimated_seconds: float


class ShardCutter:
    """Follows `cut` over records in input order and says where each shard starts, writing nothing:
    the planner's `ShardWriter` and the dry run (`dry_run.py`) cut the same shards through it."""

    def __init__(self, cut: ShardCut, *, input_field: str) -> None:
        self._cut = cut
        self._input_field = input_field
        self._first = 0
        self._count = 0
        self._chars = 0
        self._seconds = 0.0
        self.ended: list[CutShard] = []
        """The shards ended so far, in order."""

    def add(self, record: Record) -> bool:
        """Count `record` in; True when it starts a new shard (the one before it has then ended)."""
        chars = input_chars(record.data.get(self._input_field))
        seconds = self._cut.cost.seconds(1, chars)
        starts = self._count == 0 or self._cut.ends_before(
            records=self._count, seconds=self._seconds, next_seconds=seconds
        )
        if starts:
            self._end()
        self._count += 1
        self._chars += chars
        self._seconds += seconds
        return starts

    def _end(self) -> None:
        if self._count == 0:
            return
        self.ended.append(
            CutShard(
                first_record=self._first,
                record_count=self._count,
                input_chars=self._chars,
                estimated_seconds=self._cut.cost.seconds(self._count, self._chars),
            )
        )
        self._first += self._count
        self._count = 0
        self._chars = 0
        self._seconds = 0.0

    def close(self) -> list[CutShard]:
        self._end()
        return self.ended


class ShardWriteAborted(Exception):
    """Thrown into an open shard writer so that it discards what it holds."""


class ShardWriter:
    """Writes records into consecutive shard inputs, each ended where `cut` says; `input_field` is
    the record field whose characters count."""

    def __init__(self, root: str, cut: ShardCut, *, input_field: str, first_index: int = 0) -> None:
        self._root = root
        self._cutter = ShardCutter(cut, input_field=input_field)
        self._first_index = first_index
        self._stack = ExitStack()
        self._handle: BinaryIO | None = None
        self.shards: list[PlannedShard] = []

    def add(self, record: Record) -> None:
        if self._cutter.add(record):
            self._rotate()
        assert self._handle is not None
        self._handle.write(orjson.dumps(record.data, option=orjson.OPT_APPEND_NEWLINE))

    def _rotate(self) -> None:
        self._finish_current()
        index = self._first_index + len(self.shards)
        uri = shard_input_uri(self._root, index)
        self._handle = self._stack.enter_context(store_for(uri).open_write(uri))
        self.shards.append(PlannedShard(index=index, first_record=0, record_count=0, input_uri=uri))

    def _finish_current(self) -> None:
        """Close the shard being written and fill in its counts, once the cutter has ended it."""
        if self._handle is None:
            return
        self._stack.close()
        self._stack = ExitStack()
        self._handle = None
        cut = self._cutter.ended[len(self.shards) - 1]
        self.shards[-1] = replace(
            self.shards[-1],
            first_record=cut.first_record,
            record_count=cut.record_count,
            input_chars=cut.input_chars,
            estimated_seconds=cut.estimated_seconds,
        )

    def close(self) -> list[PlannedShard]:
        self._cutter.close()
        self._finish_current()
        return self.shards

    def abort(self) -> None:
        """Discard the shard being written: its writer exits with an error, so it never appears."""
        aborted = ShardWriteAborted("planning stopped")
        with suppress(ShardWriteAborted):
            self._stack.__exit__(ShardWriteAborted, aborted, None)
        self._handle = None


def job_input_options(job: Job) -> InputOptions:
    return InputOptions(format=job.input_format, text_column=job.text_column or None, id_column=job.id_column or None)


def job_records(job: Job, *, input_field: str, check: JsonlCheck, max_problems: int) -> Iterator[Record]:
    """The job's valid input records in order, each problem counted into `check`; once the last is
    read, the second pass that names duplicate ids runs where two ids may collide."""
    store = store_for(job.input_uri)
    options = job_input_options(job)
    yield from iter_records(
        lambda: store.open_read(job.input_uri),
        uri=job.input_uri,
        options=options,
        input_field=input_field,
        check=check,
        max_problems=max_problems,
    )
    suspects = colliding_id_hashes(check)
    if suspects:
        find_duplicate_records(
            lambda: store.open_read(job.input_uri),
            uri=job.input_uri,
            options=options,
            input_field=input_field,
            check=check,
            suspects=suspects,
            max_problems=max_problems,
        )


def _cut_shards(job: Job, *, input_field: str, max_problems: int) -> tuple[JsonlCheck, list[PlannedShard]]:
    check = JsonlCheck()
    writer = ShardWriter(job_root(job), ShardCut.for_job(job), input_field=input_field)
    try:
        for record in job_records(job, input_field=input_field, check=check, max_problems=max_problems):
            if check.problem_count == 0:
                writer.add(record)
    except BaseException:
        writer.abort()
        raise
    return check, writer.close()


PLANNABLE = (JobStatus.QUEUED, JobStatus.PLANNING)


def job_plan(*, job_id: str, holder: str = "planner") -> None:
    """Plan a queued job. A job found `planning` is planned again: its planner died before the
    shards were created (they are created in the same transaction that ends planning), unless a
    live planner still holds the job's plan lease."""
    try:
        with Lease(job_lease_key("plan", job_id), holder, exclusive=True):
            if job_transition(job_id=job_id, source=PLANNABLE, target=JobStatus.PLANNING):
                _plan(job_id)
    except LeaseHeld as held:
        logger.info("job %s is being planned by %s; not planning it twice", job_id, held.holder)


def _plan(job_id: str) -> None:
    job = Job.objects.select_related("model").get(pk=job_id)
    limit = settings.BATCHERY_MAX_REPORTED_PROBLEMS
    try:
        check, shards = _cut_shards(job, input_field=input_field_for(job.model.task), max_problems=limit)
    except StorageError as exc:
        job_fail(job_id=job_id, reason=f"cannot read the input: {exc}", source=JobStatus.PLANNING)
        return
    except InputOptionsError as exc:
        job_fail(job_id=job_id, reason=f"input rejected: {exc}", source=JobStatus.PLANNING)
        return
    if not check.ok:
        input_prefix = join_uri(job_root(job), "input")
        store_for(input_prefix).delete_prefix(input_prefix)
        job_fail(job_id=job_id, reason=f"input rejected: {check.summary(limit=limit)}", source=JobStatus.PLANNING)
        return

    with transaction.atomic():
        Shard.objects.bulk_create(
            Shard(
                job_id=job.id,
                index=planned.index,
                first_record=planned.first_record,
                record_count=planned.record_count,
                input_chars=planned.input_chars,
                estimated_seconds=planned.estimated_seconds,
                input_uri=planned.input_uri,
                prefix_uri=shard_prefix(job_root(job), planned.index),
            )
            for planned in shards
        )
        moved = job_transition(
            job_id=job_id,
            source=JobStatus.PLANNING,
            target=JobStatus.RUNNING,
            total_records=check.records,
            shard_count=len(shards),
            started_at=timezone.now(),
        )
        if not moved:
            # Cancelled or expired while planning: roll the shards back with the transaction.
            transaction.set_rollback(True)
            return
        from portal.jobs.services.scheduler import schedule_job

        transaction.on_commit(lambda: schedule_job(job_id=job_id))
    logger.info("job %s planned: %d records in %d shards", job_id, check.records, len(shards))
