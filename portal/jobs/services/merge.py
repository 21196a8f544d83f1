"""Merge: record each shard's committed manifest, stitch outputs in input order, end the job.

The merge trusts storage, not the chord's arguments: each shard's commit marker names the one
attempt whose output counts. A shard whose task failed for good has no marker; its records become
error lines naming the reason, so the output still holds exactly one line per input record.
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
from portal.jobs.services.transitions import job_fail, job_transition
from tasks.app import app
from tasks.shard_execution import read_committed_manifest
from tasks.specs import ShardManifest
from tasks.storage import store_for

logger = logging.getLogger(__name__)

COPY_BUFFER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ShardOutcome:
    shard: Shard
    manifest: ShardManifest | None
    """The committed attempt, or None when the shard failed for good."""
    failure: str = ""


class ShardNotFinished(Exception):
    """A shard has neither committed nor failed for good; the merge must wait (a chord fired early)."""


def _failure_reason(shard: Shard) -> str | None:
    """Why a shard's task failed for good, or None if it has not (yet) failed."""
    if not shard.task_id:
        return "the shard was never dispatched"
    result: AsyncResult[Any] = AsyncResult(shard.task_id, app=app)
    if result.state != states.FAILURE:
        return None
    exc = result.result
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(exc)


def _outcome(job: Job, shard: Shard) -> ShardOutcome:
    from portal.jobs.services.dispatch import shard_spec

    manifest = read_committed_manifest(shard_spec(job, shard))
    if manifest is not None:
        if manifest.records != shard.record_count:
            raise ValueError(f"shard {shard.index} committed {manifest.records} records but holds {shard.record_count}")
        return ShardOutcome(shard=shard, manifest=manifest)
    reason = _failure_reason(shard)
    if reason is None:
        raise ShardNotFinished(f"shard {shard.index} has not finished")
    return ShardOutcome(shard=shard, manifest=None, failure=reason)


def _record_outcome(outcome: ShardOutcome) -> None:
    shard, manifest = outcome.shard, outcome.manifest
    if manifest is None:
        Shard.objects.filter(pk=shard.pk).update(status=ShardStatus.FAILED, error=outcome.failure)
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
    )


def _copy(uri: str, target: BinaryIO) -> None:
    with store_for(uri).open_read(uri) as source:
        shutil.copyfileobj(source, target, COPY_BUFFER_BYTES)


def _write_failed_shard(outcome: ShardOutcome, output: BinaryIO, errors: BinaryIO) -> None:
    error = {"code": "shard_failed", "message": outcome.failure}
    with store_for(outcome.shard.input_uri).open_read(outcome.shard.input_uri) as source:
        for raw in source:
            line = orjson.dumps(
                {"custom_id": orjson.loads(raw)["custom_id"], "error": error}, option=orjson.OPT_APPEND_NEWLINE
            )
            output.write(line)
            errors.write(line)


def _stitch(job: Job, outcomes: list[ShardOutcome]) -> None:
    store = store_for(job.output_uri)
    with store.open_write(job.output_uri) as output, store.open_write(job.errors_uri) as errors:
        for outcome in outcomes:
            if outcome.manifest is None:
                _write_failed_shard(outcome, output, errors)
                continue
            _copy(outcome.manifest.output_uri, output)
            _copy(outcome.manifest.errors_uri, errors)


def _ending(succeeded: int, failed: int) -> str:
    if failed == 0:
        return JobStatus.SUCCEEDED
    if succeeded == 0:
        return JobStatus.FAILED
    return JobStatus.PARTIALLY_SUCCEEDED


def job_merge(*, job_id: str) -> None:
    job = Job.objects.select_related("model").get(pk=job_id)
    if job.status != JobStatus.RUNNING:
        logger.info("job %s is %s; nothing to merge", job_id, job.status)
        return
    shards = list(job.shards.order_by("index"))
    try:
        outcomes = [_outcome(job, shard) for shard in shards]
    except ShardNotFinished as exc:
        logger.warning("job %s: merge called before every shard finished (%s); waiting", job_id, exc)
        return
    except ValueError as exc:
        job_fail(job_id=job_id, reason=f"merge refused inconsistent shard output: {exc}")
        return
    if not job_transition(job_id=job_id, target=JobStatus.MERGING):
        return

    for outcome in outcomes:
        _record_outcome(outcome)
    _stitch(job, outcomes)

    succeeded = sum(o.manifest.succeeded for o in outcomes if o.manifest is not None)
    failed = sum(o.manifest.failed if o.manifest else o.shard.record_count for o in outcomes)
    shard_failures = [f"shard {o.shard.index}: {o.failure}" for o in outcomes if o.manifest is None]
    ending = _ending(succeeded, failed)
    error = ""
    if shard_failures:
        error = f"{len(shard_failures)} of {len(outcomes)} shards failed; first: {shard_failures[0]}"
    elif ending == JobStatus.FAILED:
        error = f"all {failed} records failed; see the error file"
    job_transition(
        job_id=job_id,
        target=ending,
        succeeded_records=succeeded,
        failed_records=failed,
        error=error,
        finished_at=timezone.now(),
    )
    logger.info("job %s %s: %d succeeded, %d failed", job_id, ending, succeeded, failed)
