"""Planning: stream a queued job's input once, cut it into shards, write their inputs, create rows.

Memory stays bounded whatever the input size: one record at a time is held, plus 8 bytes a record
for the duplicate-id check. A bad line stops shard writing (the check goes on to name every bad
line), and the job fails with those lines named; no shard is dispatched.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import BinaryIO

import orjson
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.services.storage_layout import job_root, shard_input_uri, shard_prefix
from portal.jobs.services.transitions import job_fail, job_transition
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


class ShardWriteAborted(Exception):
    """Thrown into an open shard writer so that it discards what it holds."""


class ShardWriter:
    """Writes records into consecutive shard inputs of `shard_size` records each."""

    def __init__(self, root: str, shard_size: int, *, first_index: int = 0) -> None:
        self._root = root
        self._shard_size = shard_size
        self._first_index = first_index
        self._stack = ExitStack()
        self._handle: BinaryIO | None = None
        self._count = 0
        self._written = 0
        self.shards: list[PlannedShard] = []

    def add(self, record: Record) -> None:
        if self._handle is None or self._count == self._shard_size:
            self._rotate()
        assert self._handle is not None
        self._handle.write(orjson.dumps(record.data, option=orjson.OPT_APPEND_NEWLINE))
        self._count += 1

    def _rotate(self) -> None:
        self._finish_current()
        index = self._first_index + len(self.shards)
        uri = shard_input_uri(self._root, index)
        self._handle = self._stack.enter_context(store_for(uri).open_write(uri))
        self.shards.append(PlannedShard(index=index, first_record=self._written, record_count=0, input_uri=uri))

    def _finish_current(self) -> None:
        if self._handle is None:
            return
        self._stack.close()
        self._stack = ExitStack()
        last = self.shards[-1]
        self.shards[-1] = PlannedShard(last.index, last.first_record, self._count, last.input_uri)
        self._written += self._count
        self._handle = None
        self._count = 0

    def close(self) -> list[PlannedShard]:
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


def _cut_shards(job: Job, *, input_field: str, max_problems: int) -> tuple[JsonlCheck, list[PlannedShard]]:
    store = store_for(job.input_uri)
    check = JsonlCheck()
    writer = ShardWriter(job_root(job), job.shard_size)
    options = job_input_options(job)
    try:
        records = iter_records(
            lambda: store.open_read(job.input_uri),
            uri=job.input_uri,
            options=options,
            input_field=input_field,
            check=check,
            max_problems=max_problems,
        )
        for record in records:
            if check.problem_count == 0:
                writer.add(record)
    except BaseException:
        writer.abort()
        raise
    shards = writer.close()
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
    return check, shards


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
        from portal.jobs.services.dispatch import job_dispatch

        transaction.on_commit(lambda: job_dispatch(job_id=job_id))
    logger.info("job %s planned: %d records in %d shards", job_id, check.records, len(shards))
