"""Planning: stream a queued job's input once, cut it into shards, write their inputs, create rows.

A job given a shard size is cut every that many records. Otherwise each shard ends before its
estimated compute seconds would pass BATCHERY_TARGET_SHARD_SECONDS, the estimate coming from the
model's learned throughput (`portal.catalog.throughput`), so a shard of long documents holds fewer
records than one of short ones and shards take about equally long (where a shard ends is
`shard_cut.py`'s). Either way each shard records its input characters and estimate, for the
scheduler to charge and to learn from.

Planning streams: each shard's row is created (pending) as soon as its input is written (the rows
of a quick burst of small shards together, see ROWS_WAIT_S), and the scheduler is asked to send
shards while the planner reads on, so a large input's first shard runs moments after submission,
not after the whole input was read. The job stays `planning` meanwhile:
schedulable, never merged (`merge_when_settled` wants `running`), until the input has been read to
its end and its record and shard counts are known.

Memory stays bounded whatever the input size: one record at a time is held, plus 8 bytes a record
for the duplicate-id check. A bad line stops shard writing (the check goes on to name every bad
line), and the job fails with those lines named: shards already sent are stopped as a cancel stops
them, the shard inputs are deleted, and nothing is merged, so nothing is published.

An input too large to count at submission (`BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES`) is held to its
tenant's `max_queued_records` here instead: the job fails, as for a bad line, once its records read so
far no longer fit beside the tenant's other queued records.

A chat or generation job whose prompts begin alike in groups (`prefix_groups.py`) is planned grouped
instead: a first pass counts the prompt beginnings, and the records of each group go into shards of
their own (`plan_grouped.py`), whose rows are all created in one transaction once every shard input
is written. So a grouped job starts its first shard after its input has been read (twice). The
first pass gives up after PROBE_RECORDS records where no beginning is shared enough, and the job is
planned streaming as above.

Once the input has been checked whole, the planner reads it once more, in order, for its digest
(`input_digest`, which the job's manifest names it by), while the shards sent already run.

A planner that died is replaced by the reconciler once its lease has lapsed and the job's
`updated_at` (touched by a live planner every few seconds) has gone stale. The new planner reads the
input again from its start, to check it whole, but writes only past the shards already created:
shards that ran are neither cut again nor sent twice. A grouped job's plan is all or nothing: with
rows, it is only checked again; without, planned again from scratch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import BinaryIO

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from portal.execution.dispatch import job_queue, shards_revoke
from portal.execution.endings import merge_when_settled
from portal.execution.input_digest import input_digest
from portal.execution.plan_grouped import GroupedShardWriter, grouped_shards_create
from portal.execution.prefix_groups import PrefixGrouping, prefix_grouping, prefix_key_for
from portal.execution.retry_round import retry_round_plan
from portal.execution.scheduler import schedule_job, schedule_queue
from portal.execution.shard_cut import PlannedShard, ShardCut
from portal.execution.shard_writer import ShardWriter
from portal.jobs.adapters import JobAdapters
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.quota import RecordsOverQuota, input_limits, records_room
from portal.jobs.record_checks import record_checks
from portal.jobs.storage_layout import job_root
from portal.jobs.transitions import job_fail, job_transition
from tasks.shared.config import LEASE_TTL_S
from tasks.shared.formats.compression import DecompressionLimitExceeded, DecompressionLimits
from tasks.shared.formats.inputs import InputOptions, InputOptionsError, find_duplicate_records, iter_records
from tasks.shared.formats.jsonl import JsonlCheck, RecordProblem, colliding_id_hashes
from tasks.shared.formats.records import Record, input_field_for
from tasks.shared.leases import Lease, LeaseHeld, job_lease_key
from tasks.shared.stops import request_stop
from tasks.shared.storage import StorageError, input_open, join_uri, store_for

logger = logging.getLogger(__name__)

SCHEDULE_EVERY_S = 0.5
"""While planning, the scheduler is asked to send shards at the first one, then at most this often:
a tick costs a queue lock and a few queries, and the shard callbacks refill the window in between."""
HEARTBEAT_EVERY_S = LEASE_TTL_S / 3
"""How often a live planner touches its job's `updated_at`: as often as it renews its plan lease, so
that the job looks stale to the reconciler only when the lease too would have lapsed."""
HEARTBEAT_RECORDS = 4096
"""Records read between two looks at the clock for the heartbeat (and for shard rows waiting)."""
ROWS_WAIT_S = 0.05
"""A shard row written within this long of the last insert waits, to be inserted with the rows that
follow it: a burst of small shards is one statement and one commit about every ROWS_WAIT_S instead of one
each (a thousand one-record shards spent a fifth of the control worker's time inserting their rows one
by one). No row waits past the scheduler's next tick from the planner, nor much past ROWS_WAIT_S."""
ROWS_PER_INSERT = 500


def job_input_options(job: Job) -> InputOptions:
    return InputOptions(format=job.input_format, text_column=job.text_column or None, id_column=job.id_column or None)


class InputPosition:
    """How far a pass over an input has read, in the input's own bytes (compressed, if it is): the
    position of the stream it opened. None before it opens, once it has closed, or where the stream
    cannot tell; read ahead of the records by the readers' buffers, which a large input dwarfs."""

    def __init__(self) -> None:
        self._stream: BinaryIO | None = None

    def track(self, stream: BinaryIO) -> BinaryIO:
        self._stream = stream
        return stream

    def __call__(self) -> int | None:
        if self._stream is None:
            return None
        try:
            return self._stream.tell()
        except (OSError, ValueError, AttributeError):
            return None


def job_records(
    job: Job,
    *,
    input_field: str,
    check: JsonlCheck,
    max_problems: int,
    position: InputPosition | None = None,
    limits: DecompressionLimits | None = None,
    record_problem: RecordProblem | None = None,
) -> Iterator[Record]:
    """The job's valid input records in order, each problem counted into `check` (those `record_problem`
    finds too); once the last is read, the second pass that names duplicate ids runs where two ids may
    collide. `position` follows the first pass. A compressed input is bounded by `limits`, by default the
    tenant's (`input_limits`): `DecompressionLimitExceeded` past them."""
    options = job_input_options(job)
    limits = limits or input_limits(job.tenant_id)

    def open_input() -> BinaryIO:
        stream = input_open(job.input_uri)
        return position.track(stream) if position is not None else stream

    yield from iter_records(
        open_input,
        uri=job.input_uri,
        options=options,
        input_field=input_field,
        check=check,
        max_problems=max_problems,
        limits=limits,
        record_problem=record_problem,
    )
    suspects = colliding_id_hashes(check)
    if suspects:
        find_duplicate_records(
            lambda: input_open(job.input_uri),
            uri=job.input_uri,
            options=options,
            input_field=input_field,
            check=check,
            suspects=suspects,
            max_problems=max_problems,
            limits=limits,
        )


class PlanningStopped(Exception):
    """The job left `planning` (cancelled, expired) while its planner was reading."""


class TooManyShards(Exception):
    """The job's input needs more shards than one job may have (`BATCHERY_MAX_SHARDS_PER_JOB`)."""


def shard_within_limit(planned: PlannedShard) -> None:
    """Raise TooManyShards once a job's shards pass BATCHERY_MAX_SHARDS_PER_JOB."""
    limit = settings.BATCHERY_MAX_SHARDS_PER_JOB
    if planned.index >= limit:
        raise TooManyShards(
            f"the input needs more than {limit} shards, the most one job may have "
            "(BATCHERY_MAX_SHARDS_PER_JOB): give a larger shard_size or split the input into several jobs"
        )


class StreamingDispatch:
    """Creates each shard's row soon after its input is written and, while the input is still being
    read, has the scheduler send shards: at the first shard, then at most every SCHEDULE_EVERY_S.
    Rows of shards written in a quick burst are inserted together (ROWS_WAIT_S), always before a tick.
    Also the planner's heartbeat: it keeps the job's `updated_at` fresh, so that the reconciler does
    not take a live planner for a dead one even when Redis (and the plan lease) was lost, and it
    notices a job that left `planning`."""

    def __init__(self, job: Job) -> None:
        self._job_id = str(job.id)
        self._root = job_root(job)
        self._scheduled_at: float | None = None
        self._beat_at = time.monotonic()
        self._inserted_at = -ROWS_WAIT_S
        self._waiting: list[Shard] = []
        self.reading = True
        """False once the input has been read: planning's end schedules the last shards."""

    def shard_written(self, planned: PlannedShard) -> None:
        shard_within_limit(planned)
        self._waiting.append(planned.row(job_id=self._job_id, root=self._root))
        now = time.monotonic()
        schedule = self.reading and (self._scheduled_at is None or now - self._scheduled_at >= SCHEDULE_EVERY_S)
        if schedule or now - self._inserted_at >= ROWS_WAIT_S or len(self._waiting) >= ROWS_PER_INSERT:
            self.insert_rows()
        if schedule:
            self._scheduled_at = now
            job_id = self._job_id
            transaction.on_commit(lambda: schedule_job(job_id=job_id))
        self.beat()

    def insert_rows(self) -> None:
        """Create the rows of the shards written so far, in one statement, committed at once (autocommit)
        so the scheduler sees them. In index order, all or none: the rows created are always the first
        ones, which a resumed planner relies on. A conflict is a shard a concurrent planner (one that
        ran without Redis, so without its lease) created."""
        if self._waiting:
            Shard.objects.bulk_create(self._waiting, ignore_conflicts=True)
            self._waiting = []
        self._inserted_at = time.monotonic()

    def records_read(self) -> None:
        """Called every HEARTBEAT_RECORDS records: rows that waited past ROWS_WAIT_S while a large shard is
        being written are inserted, and the heartbeat is beaten if it is time."""
        if self._waiting and time.monotonic() - self._inserted_at >= ROWS_WAIT_S:
            self.insert_rows()
        self.beat()

    def beat(self) -> None:
        """Touch the job's `updated_at` if it is time; raise PlanningStopped if it is no longer planning."""
        now = time.monotonic()
        if now - self._beat_at < HEARTBEAT_EVERY_S:
            return
        self._beat_at = now
        if not Job.objects.filter(pk=self._job_id, status=JobStatus.PLANNING).update(updated_at=timezone.now()):
            raise PlanningStopped(f"job {self._job_id} is no longer planning")


def _planned_so_far(job: Job) -> tuple[int, int]:
    """(shards, records) an earlier planner of this job already created: planning resumes after them.

    Shard rows are created in index order, each insert all or none, so the first `shards` indices are taken."""
    planned = job.shards.filter(round=0).aggregate(shards=Count("id"), records=Sum("record_count"))
    return planned["shards"], planned["records"] or 0


def _prefix_grouping(job: Job, *, input_field: str, dispatch: StreamingDispatch) -> PrefixGrouping | None:
    """The groups a job is planned in (`prefix_groups.py`), from a first pass over its records up to its
    first bad one (the pass that writes the shards names the bad lines); None: planned ungrouped."""
    key = prefix_key_for(job)
    if key is None:
        return None
    check = JsonlCheck()

    def records() -> Iterator[Record]:
        for record in iter_records(
            lambda: input_open(job.input_uri),
            uri=job.input_uri,
            options=job_input_options(job),
            input_field=input_field,
            check=check,
            max_problems=1,
            limits=input_limits(job.tenant_id),
        ):
            if check.problem_count:
                return
            yield record
            if check.records % HEARTBEAT_RECORDS == 0:
                dispatch.records_read()

    return prefix_grouping(key, records())


def _cut_shards(
    job: Job,
    *,
    input_field: str,
    max_problems: int,
    dispatch: StreamingDispatch,
    resumed: bool,
    grouping: PrefixGrouping | None = None,
) -> JsonlCheck:
    # A job planned for the first time has no shards yet: only a resumed planner looks.
    first_index, covered = _planned_so_far(job) if resumed else (0, 0)
    check = JsonlCheck()
    position = InputPosition()
    writer: ShardWriter | GroupedShardWriter
    if grouping is not None:
        # Rows only once every input is written (plan_grouped.py); a grouped job has no rows before.
        writer = GroupedShardWriter(
            job_root(job),
            ShardCut.for_job(job),
            input_field=input_field,
            grouping=grouping,
            on_shard=shard_within_limit,
        )
    else:
        writer = ShardWriter(
            job_root(job),
            ShardCut.for_job(job),
            input_field=input_field,
            first_index=first_index,
            first_record=covered,
            on_shard=dispatch.shard_written,
            bytes_read=position,
        )
    writing = True
    room = records_room(job)
    adapters = JobAdapters(job.tenant, job.model, job.adapters)
    try:
        for record in job_records(
            job,
            input_field=input_field,
            check=check,
            max_problems=max_problems,
            position=position,
            record_problem=record_checks(job.model, adapters),
        ):
            if adapters.added:
                # Saved before the record's shard gets its row: every shard sent carries the adapters it names.
                _save_adapters(job, adapters)
            if room is not None:
                room.check(check.records)
            if check.problem_count:
                if writing:
                    # A bad line: the shard being written never gets a row; the check reads on.
                    writer.abort()
                    writing = False
            elif check.records > covered and not job.prefix_groups:
                # A grouped job with rows has its whole plan: its records are only checked again.
                writer.add(record)
            if check.records % HEARTBEAT_RECORDS == 0:
                dispatch.records_read()
    except Exception:
        writer.abort()
        # Planning refused or stopped: the shards written whole keep their rows, whenever they were written.
        dispatch.insert_rows()
        raise
    except BaseException:
        writer.abort()
        raise
    dispatch.reading = False
    if check.ok:
        planned = writer.close()
        if isinstance(writer, GroupedShardWriter) and not grouped_shards_create(
            job=job, shards=planned, groups=writer.groups
        ):
            raise PlanningStopped(f"job {job.id} is no longer planning, or another planner created its shards")
    elif writing:
        writer.abort()
    dispatch.insert_rows()
    return check


def _save_adapters(job: Job, adapters: JobAdapters) -> None:
    job.adapters = dict(adapters.entries)
    Job.objects.filter(pk=job.pk).update(adapters=job.adapters)
    adapters.added = False


def job_plan(*, job_id: str, worker: str = "planner") -> None:
    """Plan a queued job. A job found `planning` is planned again, resuming after the shards already
    created: its planner died, unless a live planner still holds the job's plan lease."""
    try:
        with Lease(job_lease_key("plan", job_id), worker, exclusive=True):
            if job_transition(job_id=job_id, source=JobStatus.QUEUED, target=JobStatus.PLANNING):
                _plan(job_id, resumed=False)
            elif job_transition(job_id=job_id, source=JobStatus.PLANNING, target=JobStatus.PLANNING):
                _plan(job_id, resumed=True)
    except LeaseHeld as held:
        logger.info("job %s is being planned by %s; not planning it twice", job_id, held.holder)


def _plan(job_id: str, *, resumed: bool) -> None:
    job = Job.objects.select_related("model__gpu_class", "tenant").get(pk=job_id)
    if job.retry_round:
        # A retry round: only the last round's failed records are cut, from its shard inputs.
        retry_round_plan(job)
        return
    limit = settings.BATCHERY_MAX_REPORTED_PROBLEMS
    dispatch = StreamingDispatch(job)
    input_field = input_field_for(job.model.task)
    try:
        # A job with shards already keeps its plan: streamed (resumed after them), or grouped (whole).
        planned = resumed and job.shards.filter(round=0).exists()
        grouping = None if planned else _prefix_grouping(job, input_field=input_field, dispatch=dispatch)
        check = _cut_shards(
            job, input_field=input_field, max_problems=limit, dispatch=dispatch, resumed=resumed, grouping=grouping
        )
    except PlanningStopped:
        logger.info("job %s left planning while its input was read; planning stops", job_id)
        return
    except (RecordsOverQuota, TooManyShards) as exc:
        _refuse(job, str(exc))
        return
    except StorageError as exc:
        _refuse(job, f"cannot read the input: {exc}")
        return
    except (InputOptionsError, DecompressionLimitExceeded) as exc:
        _refuse(job, f"input rejected: {exc}")
        return
    if not check.ok:
        _refuse(job, f"input rejected: {check.summary(limit=limit)}")
        return
    if job.prefix_groups and _planned_so_far(job)[1] != check.records:
        _refuse(job, f"the input changed while it was planned: {check.records} records, the plan holds others")
        return
    try:
        # Read once more, in order, while the shards already sent run: the manifest names the input by it.
        digest = input_digest(job.input_uri, beat=dispatch.beat)
    except PlanningStopped:
        logger.info("job %s left planning while its input was read; planning stops", job_id)
        return
    except StorageError as exc:
        _refuse(job, f"cannot read the input: {exc}")
        return

    shard_count = job.shards.filter(round=0).count()
    moved = job_transition(
        job_id=job_id,
        source=JobStatus.PLANNING,
        target=JobStatus.RUNNING,
        total_records=check.records,
        shard_count=shard_count,
        started_at=timezone.now(),
        input_digest=digest,
    )
    if not moved:
        # Cancelled or expired while planning: its shards stay unsent, those sent were stopped.
        return
    transaction.on_commit(lambda: _planning_ended(job, shard_count))
    logger.info("job %s planned: %d records", job_id, check.records)


def _planning_ended(job: Job, shard_count: int) -> None:
    """Send what is left to send; merge at once if every shard already finished while planning went on
    (their callbacks found the job `planning` and did not merge). A job without shards merges."""
    if not shard_count:
        schedule_job(job_id=str(job.id))
        return
    schedule_queue(job_queue(job))
    merge_when_settled(job)


def _refuse(job: Job, reason: str) -> None:
    """Fail a job whose input turned out unreadable or bad, maybe after some of its shards ran: they
    are stopped as a cancel stops them, the shard inputs deleted; nothing is merged or published."""
    job_id = str(job.id)
    # The flag first: a shard that arrives from now on does not start.
    request_stop(job_id, JobStatus.FAILED)
    if not job_fail(job_id=job_id, reason=reason, source=JobStatus.PLANNING):
        return
    shards_revoke(job)
    input_prefix = join_uri(job_root(job), "input")
    try:
        store_for(input_prefix).delete_prefix(input_prefix)
    except StorageError as exc:
        # The job has its ending; shard inputs left behind cost space, not correctness.
        logger.warning("job %s: could not delete its shard inputs: %s", job_id, exc)
