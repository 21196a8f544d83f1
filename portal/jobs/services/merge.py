"""Merge: record each shard's committed manifest, stitch outputs in input order, end the job.

The merge trusts storage, not the chord's arguments: each shard's commit marker names the one
attempt whose output counts, and the merge publishes only once every shard has committed or failed
for good, so a chord that fires early or twice cannot corrupt the output. A shard whose task failed
for good has no marker; its records become error lines naming the reason. A shard whose task died
of something a new attempt may survive (a time limit, a lost worker) is dispatched again.

When a job is stopped (cancelled, expired) the merge does not wait: committed shards are kept and
every other record becomes an error line with the stop reason as its code.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson
from celery import states
from celery.result import AsyncResult
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.jobs.services.storage_layout import job_root, parquet_output_uri
from portal.jobs.services.transitions import job_fail, job_transition
from tasks.app import app
from tasks.config import SHARD_MAX_DISPATCHES
from tasks.formats.parquet_output import ParquetOutputError, jsonl_to_parquet
from tasks.leases import Lease, LeaseHeld, job_lease_key
from tasks.shard_execution import read_committed_manifest
from tasks.specs import ShardManifest
from tasks.storage import store_for

logger = logging.getLogger(__name__)

COPY_BUFFER_BYTES = 1024 * 1024
# Failures a new attempt may not repeat: the task was killed or its process died.
TRANSIENT_FAILURES = frozenset({"TimeLimitExceeded", "SoftTimeLimitExceeded", "WorkerLostError", "Terminated"})
STOP_ENDINGS = {"cancelled": JobStatus.CANCELLED, "expired": JobStatus.EXPIRED}


@dataclass(frozen=True)
class ShardOutcome:
    shard: Shard
    manifest: ShardManifest | None
    """The committed attempt, or None when the shard failed for good or was stopped."""
    failure: str = ""
    code: str = "shard_failed"
    """Error code given to the records of a shard without a committed attempt."""


@dataclass(frozen=True)
class TaskFailure:
    reason: str
    transient: bool


def task_failure(shard: Shard) -> TaskFailure | None:
    """How a shard's current task failed, or None if it has not failed (it may still be running)."""
    if not shard.task_id:
        return None
    result: AsyncResult[Any] = AsyncResult(shard.task_id, app=app)
    if result.state != states.FAILURE:
        return None
    exc = result.result
    name = type(exc).__name__ if isinstance(exc, BaseException) else "Error"
    reason = f"{name}: {exc}" if isinstance(exc, BaseException) else str(exc)
    return TaskFailure(reason=reason, transient=name in TRANSIENT_FAILURES)


def read_manifest(job: Job, shard: Shard) -> ShardManifest | None:
    from portal.jobs.services.dispatch import shard_spec

    manifest = read_committed_manifest(shard_spec(job, shard))
    if manifest is not None and manifest.records != shard.record_count:
        raise ValueError(f"shard {shard.index} committed {manifest.records} records but holds {shard.record_count}")
    return manifest


def _record_outcome(outcome: ShardOutcome) -> None:
    shard, manifest = outcome.shard, outcome.manifest
    if manifest is None:
        Shard.objects.filter(pk=shard.pk).update(
            status=ShardStatus.FAILED, error=outcome.failure, error_codes={outcome.code: shard.record_count}
        )
        return
    Shard.objects.filter(pk=shard.pk).update(
        status=ShardStatus.SUCCEEDED,
        attempt_id=manifest.attempt_id,
        output_uri=manifest.output_uri,
        errors_uri=manifest.errors_uri,
        succeeded_records=manifest.succeeded,
        failed_records=manifest.failed,
        prompt_tokens=manifest.prompt_tokens,
        completion_tokens=manifest.completion_tokens,
        worker=manifest.worker,
        worker_pid=manifest.pid,
        cache_hit=manifest.cache_hit,
        started_at=dt.datetime.fromtimestamp(manifest.started_at, tz=dt.UTC),
        finished_at=dt.datetime.fromtimestamp(manifest.finished_at, tz=dt.UTC),
        compute_seconds=manifest.compute_seconds,
        load_seconds=manifest.load_seconds,
        error_codes=manifest.error_codes,
    )


def _copy(uri: str, target: BinaryIO) -> None:
    with store_for(uri).open_read(uri) as source:
        shutil.copyfileobj(source, target, COPY_BUFFER_BYTES)


def _write_unfinished_shard(outcome: ShardOutcome, output: BinaryIO, errors: BinaryIO) -> None:
    for _, line in _unfinished_lines(outcome):
        output.write(line)
        errors.write(line)


def _stitch(job: Job, outcomes: list[ShardOutcome]) -> None:
    store = store_for(job.output_uri)
    with store.open_write(job.output_uri) as output, store.open_write(job.errors_uri) as errors:
        for outcome in outcomes:
            if outcome.manifest is None:
                _write_unfinished_shard(outcome, output, errors)
                continue
            _copy(outcome.manifest.output_uri, output)
            _copy(outcome.manifest.errors_uri, errors)


def _unfinished_lines(outcome: ShardOutcome) -> list[tuple[str, bytes]]:
    error = {"code": outcome.code, "message": outcome.failure}
    with store_for(outcome.shard.input_uri).open_read(outcome.shard.input_uri) as source:
        ids = [orjson.loads(raw)["custom_id"] for raw in source]
    return [
        (custom_id, orjson.dumps({"custom_id": custom_id, "error": error}, option=orjson.OPT_APPEND_NEWLINE))
        for custom_id in ids
    ]


def _replacements(outcomes: list[ShardOutcome]) -> dict[str, bytes]:
    """The new line of every record a retry round ran (bounded by the records retried)."""
    lines: dict[str, bytes] = {}
    for outcome in outcomes:
        if outcome.manifest is None:
            lines.update(_unfinished_lines(outcome))
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


def _write_parquet(job: Job) -> None:
    """The Parquet copy of the stitched JSONL output, streamed row group by row group."""
    target = parquet_output_uri(job_root(job))
    with store_for(job.output_uri).open_read(job.output_uri) as lines, store_for(target).open_write(target) as out:
        jsonl_to_parquet(lines, out, task=job.model.task)


def _ending(succeeded: int, failed: int) -> str:
    if failed == 0:
        return JobStatus.SUCCEEDED
    if succeeded == 0:
        return JobStatus.FAILED
    return JobStatus.PARTIALLY_SUCCEEDED


def _outcomes_when_finished(job: Job, shards: list[Shard]) -> list[ShardOutcome] | None:
    """Every shard's outcome, or None (after sending again what may yet succeed) if some are unfinished."""
    outcomes, resend, waiting = [], [], 0
    for shard in shards:
        manifest = read_manifest(job, shard)
        if manifest is not None:
            outcomes.append(ShardOutcome(shard=shard, manifest=manifest))
            continue
        if shard.status == ShardStatus.FAILED:
            outcomes.append(ShardOutcome(shard=shard, manifest=None, failure=shard.error))
            continue
        failure = task_failure(shard)
        if failure is None:
            waiting += 1
        elif failure.transient and shard.attempt < SHARD_MAX_DISPATCHES:
            resend.append(shard)
        else:
            reason = failure.reason if not failure.transient else f"{failure.reason} ({shard.attempt} dispatches)"
            outcomes.append(ShardOutcome(shard=shard, manifest=None, failure=reason))
    if resend:
        from portal.jobs.services.dispatch import job_redispatch

        job_redispatch(job_id=str(job.id), shards=resend, reason="its task was killed or its worker lost")
    if resend or waiting:
        logger.info("job %s: %d shards unfinished, %d sent again; merge waits", job.id, waiting, len(resend))
        return None
    return outcomes


def _stopped_outcomes(job: Job, shards: list[Shard], reason: str) -> list[ShardOutcome]:
    outcomes = []
    message = f"the job was {reason} before this record ran"
    for shard in shards:
        manifest = read_manifest(job, shard)
        outcomes.append(ShardOutcome(shard=shard, manifest=manifest, failure=message, code=reason))
    return outcomes


def job_merge(*, job_id: str, stop: str | None = None, holder: str = "merger") -> None:
    """Merge a running job once its shards are done, or at once a job stopped with `stop`."""
    job = Job.objects.select_related("model").get(pk=job_id)
    expected = JobStatus.CANCELLING if stop == "cancelled" else JobStatus.RUNNING
    # A merge that died mid-way (its message redelivered, or sent again by the reconciler) resumes.
    resumable = {expected, JobStatus.MERGING} if stop != "cancelled" else {expected}
    if job.status not in resumable:
        logger.info("job %s is %s; nothing to merge", job_id, job.status)
        return
    try:
        with Lease(job_lease_key("merge", job_id), holder, exclusive=True):
            job.refresh_from_db()
            if job.status in resumable:
                _merge(job, stop=stop)
    except LeaseHeld as held:
        logger.info("job %s is being merged by %s already", job_id, held.holder)


def _merge(job: Job, *, stop: str | None) -> None:
    job_id = str(job.id)
    shards = list(job.shards.filter(round=job.retry_round).order_by("index"))
    try:
        outcomes = _stopped_outcomes(job, shards, stop) if stop else _outcomes_when_finished(job, shards)
    except ValueError as exc:
        job_fail(job_id=job_id, reason=f"merge refused inconsistent shard output: {exc}")
        return
    if outcomes is None:
        return
    if (
        stop != "cancelled"
        and job.status == JobStatus.RUNNING
        and not job_transition(job_id=job_id, source=JobStatus.RUNNING, target=JobStatus.MERGING)
    ):
        return

    for outcome in outcomes:
        _record_outcome(outcome)
    if job.retry_round:
        succeeded, failed = _stitch_retry(job, outcomes)
    else:
        _stitch(job, outcomes)
        succeeded = sum(o.manifest.succeeded for o in outcomes if o.manifest is not None)
        failed = sum(o.manifest.failed if o.manifest else o.shard.record_count for o in outcomes)
    if job.output_format == "parquet":
        try:
            _write_parquet(job)
        except ParquetOutputError as exc:
            job_fail(job_id=job_id, reason=f"cannot write the Parquet output: {exc}")
            return
    ending: str
    if stop:
        ending, source = STOP_ENDINGS[stop], (JobStatus.CANCELLING if stop == "cancelled" else JobStatus.MERGING)
        unfinished = sum(1 for o in outcomes if o.manifest is None)
        error = f"{stop}: {unfinished} of {len(outcomes)} shards had not finished; their records are '{stop}' errors"
    else:
        ending, source = _ending(succeeded, failed), JobStatus.MERGING
        shard_failures = [f"shard {o.shard.index}: {o.failure}" for o in outcomes if o.manifest is None]
        error = ""
        if shard_failures:
            error = f"{len(shard_failures)} of {len(outcomes)} shards failed; first: {shard_failures[0]}"
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
