"""Merge: stitch the committed shard outputs in input order and end the job.

The merge trusts storage, not messages: each shard's commit marker names the one attempt whose
output counts, and the merge publishes only once every shard is settled, committed or failed for
good (`portal.execution.settle`; sending shards again is the scheduler's), so a merge sent
early or twice cannot corrupt the output. A shard that failed for good has no marker; its records
become error lines naming the reason.

The first round is stitched as its shards finish (`job_merge_advance`, called as each shard
settles): the longest run of settled shards after what is stitched already is appended to a staged
copy of the output and of the error file (`tasks.shared.storage.staged`), invisible until published, and a
cursor beside the job's objects says how far each got. The merge at the end appends the rest and
publishes, so a job ends moments after its last shard. The bytes are those of a merge done whole at
the end; a stopped job, a retry round, or a staged copy found lost is merged whole, as before.

A prefix-grouped job (`plan_grouped.py`) is merged whole at the end, its shards' lines put in input
order by their positions (`merge_order.py`); the bytes are those of the same job planned ungrouped.

Before it publishes, the merge joins its committed shards' provenance into the job's manifest
(`job_manifest`, written beside the output once it is published): shards that ran on different weights
of the model fail the job there, unless the operator allows it.

When a job is stopped (cancelled, expired) the merge does not wait: committed shards are kept and
every other record becomes an error line with the stop reason as its code.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

import orjson
import redis
from django.db import transaction
from django.utils import timezone

from portal.execution.job_manifest import MixedWeights, job_manifest, job_manifest_write
from portal.execution.locks import held_unless_taken
from portal.execution.merge_order import write_errors_in_input_order, write_in_input_order
from portal.execution.settle import read_manifest, shard_record_failure, shard_record_success
from portal.execution.shard_outcomes import ShardOutcome, unfinished_lines, unfinished_shard_lines
from portal.jobs.models import COMPARABLE_ENDINGS, UNSETTLED, Job, JobStatus, Shard, ShardStatus
from portal.jobs.storage_layout import job_root, parquet_output_uri
from portal.jobs.transitions import job_fail, job_transition
from tasks import send
from tasks.shared.config import LEASE_TTL_S
from tasks.shared.formats.parquet_output import ParquetOutputError, jsonl_to_parquet
from tasks.shared.formats.parquet_pieces import PiecesDisagree, PieceSource, merge_pieces
from tasks.shared.leases import Lease, LeaseHeld, job_lease_key, lease_holder
from tasks.shared.redis_client import redis_client
from tasks.shared.specs import ShardManifest
from tasks.shared.storage import join_uri, store_for
from tasks.shared.storage.staged import (
    StagedLost,
    StagedState,
    staged_append,
    staged_discard,
    staged_min_bytes,
    staged_publish,
)

logger = logging.getLogger(__name__)

COPY_BUFFER_BYTES = 1024 * 1024
STOP_ENDINGS = {"cancelled": JobStatus.CANCELLED, "expired": JobStatus.EXPIRED}
BUDGET_STOP = "budget_exceeded"
"""The stop of a job whose tenant's monthly budget was reached while it ran (`budget_stop`): it ends as a job
with failed records does (partially succeeded, or failed where none succeeded), its finished work kept and
downloadable, its unfinished records `budget_exceeded` errors that a retry may run once the budget allows."""
STOP_MESSAGES = {BUDGET_STOP: "the tenant's monthly budget (quota monthly_budget) was reached before this record ran"}
ADVANCING = (JobStatus.RUNNING, JobStatus.PAUSED)
"""Statuses whose shards may still settle, and so be stitched as they do."""
MERGE_LOCK = "batchery:merge:{job_id}"
"""The advisory lock (`locks.held_unless_taken`) a job's merge holds, in whichever control process runs it."""
# A merge waits this long for a running advance to finish; a dead advance's lease lapses sooner.
ADVANCE_WAIT_S = 2 * LEASE_TTL_S


def _record_outcome(outcome: ShardOutcome) -> None:
    if outcome.manifest is None:
        shard_record_failure(outcome.shard, reason=outcome.failure, code=outcome.code)
    else:
        shard_record_success(outcome.shard, outcome.manifest)


def _copy(uri: str, target: BinaryIO) -> None:
    with store_for(uri).open_read(uri) as source:
        shutil.copyfileobj(source, target, COPY_BUFFER_BYTES)


def _write_outputs(outcomes: list[ShardOutcome], target: BinaryIO) -> None:
    for outcome in outcomes:
        if outcome.manifest is None:
            target.writelines(unfinished_shard_lines(outcome))
        else:
            _copy(outcome.manifest.output_uri, target)


def _write_errors(outcomes: list[ShardOutcome], target: BinaryIO) -> None:
    for outcome in outcomes:
        if outcome.manifest is None:
            target.writelines(unfinished_shard_lines(outcome))
        elif outcome.manifest.errors_uri:  # empty: none of the shard's records failed
            _copy(outcome.manifest.errors_uri, target)


@dataclass(frozen=True)
class MergeCursor:
    """How far the first round's output and error file are stitched into their staged copies."""

    output_next: int = 0
    """The first shard whose output is not staged yet."""
    errors_next: int = 0
    """The first shard whose error lines are not staged yet (on S3 they lag: a part holds 5 MiB)."""
    output: StagedState = field(default_factory=StagedState)
    errors: StagedState = field(default_factory=StagedState)
    succeeded: int = 0
    failed: int = 0
    """Records of the shards whose output is staged."""
    shard_failures: tuple[str, ...] = ()
    """`shard N: reason` of each shard failed for good whose output is staged."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_next": self.output_next,
            "errors_next": self.errors_next,
            "output": self.output.to_dict(),
            "errors": self.errors.to_dict(),
            "succeeded": self.succeeded,
            "failed": self.failed,
            "shard_failures": list(self.shard_failures),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MergeCursor:
        return cls(
            output_next=data["output_next"],
            errors_next=data["errors_next"],
            output=StagedState.from_dict(data["output"]),
            errors=StagedState.from_dict(data["errors"]),
            succeeded=data["succeeded"],
            failed=data["failed"],
            shard_failures=tuple(data["shard_failures"]),
        )


def _cursor_uri(job: Job) -> str:
    return join_uri(job_root(job), "merge", "cursor.json")


def _read_cursor(job: Job) -> MergeCursor:
    uri = _cursor_uri(job)
    store = store_for(uri)
    if not store.exists(uri):
        return MergeCursor()
    return MergeCursor.from_dict(orjson.loads(store.read_bytes(uri)))


def _write_cursor(job: Job, cursor: MergeCursor) -> None:
    uri = _cursor_uri(job)
    with store_for(uri).open_write(uri) as out:
        out.write(orjson.dumps(cursor.to_dict()))


def _drop_staging(job: Job, cursor: MergeCursor) -> None:
    """Forget what was staged; nothing of it was ever visible at the output's URIs."""
    staged_discard(job.output_uri, cursor.output)
    staged_discard(job.errors_uri, cursor.errors)
    uri = _cursor_uri(job)
    store_for(uri).delete_prefix(uri)


def _stage(job: Job, cursor: MergeCursor, outcomes: list[ShardOutcome], *, publish: bool) -> MergeCursor:
    """Stitch the outcomes past the cursor onto the staged output and error file; with `publish`,
    they are the last ones and both objects appear whole (written at once if nothing was staged)."""
    outputs = [o for o in outcomes if o.shard.index >= cursor.output_next]
    errors = [o for o in outcomes if o.shard.index >= cursor.errors_next]
    staged_output: StagedState | None = None
    staged_errors: StagedState | None = None
    if publish:
        # A grouped job is never staged ahead (`job_merge_advance`): its outcomes are all of them.
        write_outputs, write_errors = (_write_outputs, _write_errors)
        if job.prefix_groups:
            write_outputs, write_errors = write_in_input_order, write_errors_in_input_order
        staged_publish(job.output_uri, cursor.output, lambda target: write_outputs(outputs, target))
        staged_publish(job.errors_uri, cursor.errors, lambda target: write_errors(errors, target))
        staged_output, staged_errors = StagedState(), StagedState()
    else:
        if _enough_to_stage(job.output_uri, outputs, lambda manifest: manifest.output_uri):
            staged_output = staged_append(job.output_uri, cursor.output, lambda target: _write_outputs(outputs, target))
        if _enough_to_stage(job.errors_uri, errors, lambda manifest: manifest.errors_uri):
            staged_errors = staged_append(job.errors_uri, cursor.errors, lambda target: _write_errors(errors, target))
    if staged_output is not None and outputs:
        succeeded, failed = _counts(outputs)
        cursor = replace(
            cursor,
            output_next=outputs[-1].shard.index + 1,
            output=staged_output,
            succeeded=cursor.succeeded + succeeded,
            failed=cursor.failed + failed,
            shard_failures=cursor.shard_failures + _shard_failures(outputs),
        )
    if staged_errors is not None and errors:
        cursor = replace(cursor, errors_next=errors[-1].shard.index + 1, errors=staged_errors)
    return cursor


def _enough_to_stage(uri: str, outcomes: list[ShardOutcome], source_of: Callable[[ShardManifest], str]) -> bool:
    """Whether the outcomes' bytes reach what the store takes in one append: sizes are asked first
    (S3), so a shard's output is read once, not again at each settle while it waits for company."""
    least = staged_min_bytes(uri)
    if not least:
        return bool(outcomes)
    total = 0
    for outcome in outcomes:
        if outcome.manifest is None:
            total += sum(len(line) for _, line in unfinished_lines(outcome))
        else:
            source = source_of(outcome.manifest)
            total += store_for(source).size(source) if source else 0
        if total >= least:
            return True
    return False


def _counts(outcomes: list[ShardOutcome]) -> tuple[int, int]:
    succeeded = sum(o.manifest.succeeded for o in outcomes if o.manifest is not None)
    failed = sum(o.manifest.failed if o.manifest else o.shard.record_count for o in outcomes)
    return succeeded, failed


def _shard_failures(outcomes: list[ShardOutcome]) -> tuple[str, ...]:
    return tuple(f"shard {o.shard.index}: {o.failure}" for o in outcomes if o.manifest is None)


def _replacements(outcomes: list[ShardOutcome]) -> dict[str, bytes]:
    """The new line of every record a retry round ran (bounded by the records retried)."""
    lines: dict[str, bytes] = {}
    for outcome in outcomes:
        if outcome.manifest is None:
            lines.update(unfinished_lines(outcome))
            continue
        with store_for(outcome.manifest.output_uri).open_read(outcome.manifest.output_uri) as source:
            for raw in source:
                lines[orjson.loads(raw)["custom_id"]] = raw
    return lines


def _stitch_retry(job: Job, outcomes: list[ShardOutcome]) -> tuple[int, int]:
    """Put a retry round's lines in place of the error lines they replace; return the new counts."""
    replacements = _replacements(outcomes)
    store = store_for(job.output_uri)
    succeeded = failed = 0
    # The new output is written beside the old one and replaces it whole when complete.
    with (
        store.open_read(job.output_uri) as previous,
        store.open_write(job.output_uri) as output,
        store.open_write(job.errors_uri) as errors,
    ):
        for raw in previous:
            record = orjson.loads(raw)
            line = replacements.get(record["custom_id"])
            if line is not None:
                record = orjson.loads(line)
            else:
                line = raw
            output.write(line)
            if "error" in record:
                errors.write(line)
                failed += 1
            else:
                succeeded += 1
    return succeeded, failed


def _write_parquet(job: Job, outcomes: list[ShardOutcome]) -> None:
    """The Parquet output: the shards' committed Parquet pieces concatenated, or where a shard has
    none (it ran before pieces, or its rows did not fit), the stitched JSONL converted."""
    target = parquet_output_uri(job_root(job))
    # A grouped job's pieces are not in input order: its JSONL, merged in order, is converted.
    pieces = all(o.manifest is None or o.manifest.parquet_uri for o in outcomes)
    if not job.retry_round and not job.prefix_groups and pieces:
        try:
            with store_for(target).open_write(target) as out:
                merge_pieces([_piece_source(outcome) for outcome in outcomes], out, task=job.model.task)
            return
        except PiecesDisagree as exc:
            logger.info("job %s: the Parquet pieces disagree (%s); converting the JSONL instead", job.id, exc)
    with store_for(job.output_uri).open_read(job.output_uri) as lines, store_for(target).open_write(target) as out:
        jsonl_to_parquet(lines, out, task=job.model.task)


def _piece_source(outcome: ShardOutcome) -> PieceSource:
    if outcome.manifest is None:
        return PieceSource(lines=lambda: unfinished_shard_lines(outcome))
    uri = outcome.manifest.parquet_uri
    return PieceSource(piece=lambda: store_for(uri).open_read(uri))


def _ending(succeeded: int, failed: int) -> str:
    if failed == 0:
        return JobStatus.SUCCEEDED
    if succeeded == 0:
        return JobStatus.FAILED
    return JobStatus.PARTIALLY_SUCCEEDED


def _outcomes_when_settled(shards: list[Shard]) -> list[ShardOutcome] | None:
    """Every shard's outcome, or None while some shard is not settled (the merge waits for the last)."""
    if any(shard.status in UNSETTLED for shard in shards):
        return None
    outcomes = []
    for shard in shards:
        if shard.status == ShardStatus.FAILED:
            outcomes.append(ShardOutcome(shard=shard, manifest=None, failure=shard.error))
            continue
        manifest = read_manifest(shard)
        if manifest is None:
            raise ValueError(f"shard {shard.index} is marked succeeded but has no commit marker")
        outcomes.append(ShardOutcome(shard=shard, manifest=manifest))
    return outcomes


def _stopped_outcomes(shards: list[Shard], reason: str) -> list[ShardOutcome]:
    outcomes = []
    message = STOP_MESSAGES.get(reason, f"the job was {reason} before this record ran")
    for shard in shards:
        manifest = read_manifest(shard)
        outcomes.append(ShardOutcome(shard=shard, manifest=manifest, failure=message, code=reason))
    return outcomes


def job_merge_advance(*, job_id: str, worker: str = "advance") -> None:
    """Stitch the first round's settled shards that follow what is stitched already, while the
    job's later shards run; what this leaves (a lease held, a store that failed) the next call or
    the merge at the end takes. A prefix-grouped job is not stitched ahead: its shards' records
    interleave, so no shard's lines are final before the last shard settles."""
    try:
        job = Job.objects.get(pk=job_id)
        if job.status not in ADVANCING or job.retry_round or job.prefix_groups:
            return
        # A lease taken without Redis excludes nobody, and two stitchers could race the merge's
        # publish: without Redis, the merge at the end does it all.
        redis_client().ping()
        with Lease(job_lease_key("merge-advance", job_id), worker, exclusive=True):
            # Taken after ours, the merge lease means the merge at the end has begun: it stitches
            # the rest itself (and waits for our lease before it reads the cursor).
            if lease_holder(job_lease_key("merge", job_id)) is not None:
                return
            job.refresh_from_db()
            if job.status in ADVANCING and not job.retry_round and not job.prefix_groups:
                _advance(job)
    except (LeaseHeld, redis.RedisError):
        return
    except Exception:
        # Stitching ahead only saves the merge time; whatever stops it must not fail the shard's settling.
        logger.warning("job %s: could not stitch finished shards ahead of the merge", job_id, exc_info=True)


def _advance(job: Job) -> None:
    cursor = _read_cursor(job)
    start = min(cursor.output_next, cursor.errors_next)
    shards = job.shards.filter(round=0, index__gte=start)
    first_unsettled = shards.filter(status__in=UNSETTLED).order_by("index").values_list("index", flat=True).first()
    if first_unsettled is not None:
        shards = shards.filter(index__lt=first_unsettled)
    outcomes = _outcomes_when_settled(list(shards.order_by("index")))
    if not outcomes:
        return
    advanced = _stage(job, cursor, outcomes, publish=False)
    if advanced != cursor:
        _write_cursor(job, advanced)


def _wait_for_advances(job_id: str) -> None:
    """Hold the merge until a running advance has finished (new ones see the merge lease and stop)."""
    key = job_lease_key("merge-advance", job_id)
    deadline = time.monotonic() + ADVANCE_WAIT_S
    while (holder := lease_holder(key)) is not None:
        if time.monotonic() > deadline:
            raise LeaseHeld(key, holder)
        time.sleep(0.01)


def job_merge(*, job_id: str, stop: str | None = None, worker: str = "merger") -> None:
    """Merge a running job once its shards are done, or at once a job stopped with `stop`."""
    # A merge that died mid-way (its message redelivered, or sent again by the reconciler) resumes.
    if stop == "cancelled":
        resumable = {JobStatus.CANCELLING}
    elif stop in ("expired", BUDGET_STOP):
        resumable = {JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.MERGING}  # a deadline runs on while paused
    else:
        resumable = {JobStatus.RUNNING, JobStatus.MERGING}
    try:
        # The lease tells the sweep and the advances a merge runs; the advisory lock keeps a second merge
        # out even when the lease was lost with Redis, or lapsed while its holder was held up.
        with (
            Lease(job_lease_key("merge", job_id), worker, exclusive=True),
            held_unless_taken(MERGE_LOCK.format(job_id=job_id)) as held,
        ):
            if not held:
                logger.info("job %s is being merged by another control process already", job_id)
                return
            _wait_for_advances(job_id)
            # Read under the lease: what an earlier holder did is in the row.
            job = Job.objects.select_related("model").get(pk=job_id)
            if job.status not in resumable:
                logger.info("job %s is %s; nothing to merge", job_id, job.status)
                return
            _merge(job, stop=stop)
    except LeaseHeld as held:
        logger.info("job %s is being merged by %s already", job_id, held.holder)


def _merge(job: Job, *, stop: str | None) -> None:
    job_id = str(job.id)
    shards = list(job.shards.filter(round=job.retry_round).order_by("index"))
    cursor = MergeCursor() if job.retry_round else _read_cursor(job)
    if stop:
        # A stopped job's unfinished shards read as stop errors, failed ones included: merged whole.
        _drop_staging(job, cursor)
        cursor = MergeCursor()
    start = min(cursor.output_next, cursor.errors_next)
    try:
        outcomes = (
            _stopped_outcomes(shards, stop)
            if stop
            else _outcomes_when_settled([shard for shard in shards if shard.index >= start])
        )
    except ValueError as exc:
        _drop_staging(job, cursor)
        job_fail(job_id=job_id, reason=f"merge refused inconsistent shard output: {exc}")
        return
    if outcomes is None:
        return
    if (
        stop != "cancelled"
        and job.status in (JobStatus.RUNNING, JobStatus.PAUSED)
        and not job_transition(job_id=job_id, source=job.status, target=JobStatus.MERGING)
    ):
        return

    for outcome in outcomes:
        _record_outcome(outcome)
    try:
        manifest = job_manifest(job, outcomes, stopped=bool(stop))
    except MixedWeights as exc:
        _drop_staging(job, cursor)
        job_fail(job_id=job_id, reason=str(exc))
        return
    except ValueError as exc:
        _drop_staging(job, cursor)
        job_fail(job_id=job_id, reason=f"merge refused inconsistent shard output: {exc}")
        return
    if job.retry_round:
        succeeded, failed = _stitch_retry(job, outcomes)
        shard_failures = _shard_failures(outcomes)
    else:
        try:
            merged = _stage(job, cursor, outcomes, publish=True)
        except StagedLost as exc:
            # Published already by a merge that died before it could end the job, or lost: start over.
            logger.warning("job %s: %s; merging every shard again", job_id, exc)
            _drop_staging(job, cursor)
            merged = _stage(job, MergeCursor(), _outcomes_when_settled(shards) or [], publish=True)
        _drop_staging(job, MergeCursor())
        succeeded, failed, shard_failures = merged.succeeded, merged.failed, merged.shard_failures
    if job.output_format == "parquet":
        try:
            # Every shard's outcome: those stitched ahead are not among `outcomes`.
            _write_parquet(job, outcomes if stop else _outcomes_when_settled(shards) or [])
        except ParquetOutputError as exc:
            job_fail(job_id=job_id, reason=f"cannot write the Parquet output: {exc}")
            return
    job_manifest_write(job, manifest)
    ending: str
    if stop == BUDGET_STOP:
        ending, source = _ending(succeeded, failed), JobStatus.MERGING
        unfinished = sum(1 for o in outcomes if o.manifest is None)
        error = (
            ""
            if not unfinished
            else (
                f"{BUDGET_STOP}: the tenant's monthly budget (quota monthly_budget) was reached while the job ran; "
                f"{unfinished} of {len(outcomes)} shards had not finished, their records are '{BUDGET_STOP}' errors; "
                "finished records are kept"
            )
        )
    elif stop:
        ending, source = STOP_ENDINGS[stop], (JobStatus.CANCELLING if stop == "cancelled" else JobStatus.MERGING)
        unfinished = sum(1 for o in outcomes if o.manifest is None)
        error = f"{stop}: {unfinished} of {len(outcomes)} shards had not finished; their records are '{stop}' errors"
    else:
        ending, source = _ending(succeeded, failed), JobStatus.MERGING
        error = ""
        if shard_failures:
            error = f"{len(shard_failures)} of {len(shards)} shards failed; first: {shard_failures[0]}"
        elif ending == JobStatus.FAILED:
            error = f"all {failed} records failed; see the error file"
    job_transition(
        job_id=job_id,
        source=source,
        target=ending,
        succeeded_records=succeeded,
        failed_records=failed,
        error=error,
        finished_at=timezone.now(),
    )
    logger.info("job %s %s: %d succeeded, %d failed", job_id, ending, succeeded, failed)
    if job.rerun_of_id is not None and ending in COMPARABLE_ENDINGS:
        # Its comparison report is written now, so the first to ask reads a file (`services.comparison`).
        transaction.on_commit(lambda: send.send_comparison(job_id))
