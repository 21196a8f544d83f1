"""Merge: stitch the committed shard outputs in input order and end the job.

The merge trusts storage, not messages: each shard's commit marker names the one attempt whose
output counts, and the merge publishes only once every shard is settled, committed or failed for
good (`portal.jobs.services.settle`; sending shards again is the scheduler's), so a merge sent
early or twice cannot corrupt the output. A shard that failed for good has no marker; its records
become error lines naming the reason.

When a job is stopped (cancelled, expired) the merge does not wait: committed shards are kept and
every other record becomes an error line with the stop reason as its code.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from typing import BinaryIO

import orjson
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.jobs.services.settle import UNSETTLED, read_manifest, shard_record_failure, shard_record_success
from portal.jobs.services.storage_layout import job_root, parquet_output_uri
from portal.jobs.services.transitions import job_fail, job_transition
from tasks.formats.parquet_output import ParquetOutputError, jsonl_to_parquet
from tasks.leases import Lease, LeaseHeld, job_lease_key
from tasks.specs import ShardManifest
from tasks.storage import store_for

logger = logging.getLogger(__name__)

COPY_BUFFER_BYTES = 1024 * 1024
STOP_ENDINGS = {"cancelled": JobStatus.CANCELLED, "expired": JobStatus.EXPIRED}


@dataclass(frozen=True)
class ShardOutcome:
    shard: Shard
    manifest: ShardManifest | None
    """The committed attempt, or None when the shard failed for good or was stopped."""
    failure: str = ""
    code: str = "shard_failed"
    """Error code given to the records of a shard without a committed attempt."""


def _record_outcome(outcome: ShardOutcome) -> None:
    if outcome.manifest is None:
        shard_record_failure(outcome.shard, reason=outcome.failure, code=outcome.code)
    else:
        shard_record_success(outcome.shard, outcome.manifest)


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
    message = f"the job was {reason} before this record ran"
    for shard in shards:
        manifest = read_manifest(shard)
        outcomes.append(ShardOutcome(shard=shard, manifest=manifest, failure=message, code=reason))
    return outcomes


def job_merge(*, job_id: str, stop: str | None = None, holder: str = "merger") -> None:
    """Merge a running job once its shards are done, or at once a job stopped with `stop`."""
    job = Job.objects.select_related("model").get(pk=job_id)
    # A merge that died mid-way (its message redelivered, or sent again by the reconciler) resumes.
    if stop == "cancelled":
        resumable = {JobStatus.CANCELLING}
    elif stop == "expired":
        resumable = {JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.MERGING}  # a deadline runs on while paused
    else:
        resumable = {JobStatus.RUNNING, JobStatus.MERGING}
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
        outcomes = _stopped_outcomes(shards, stop) if stop else _outcomes_when_settled(shards)
    except ValueError as exc:
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
