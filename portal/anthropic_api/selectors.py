"""Message batches as Anthropic's API shows them: status, counts and timestamps read off the job, and the
results read off the job's merged output."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson
from django.urls import reverse
from rest_framework.request import Request

from portal.anthropic_api.formats.results import errored, result_line
from portal.anthropic_api.models import MessageBatch
from portal.anthropic_api.storage import message_batch_input
from portal.jobs.input_display import tenant_job_error
from portal.jobs.models import Job, JobStatus
from portal.jobs.selectors import job_steps
from tasks.shared.formats.records import REFUSED_FIELD
from tasks.shared.storage import store_for

READ_CHUNK_BYTES = 256 * 1024


def processing_status(batch: MessageBatch) -> str:
    """`in_progress`, `canceling` or `ended`, from the job; a batch without a job (none of its requests could
    run, or an operator deleted it) has ended."""
    job = batch.job
    if job is None or job.is_finished:
        return "ended"
    return "canceling" if job.status == JobStatus.CANCELLING else "in_progress"


def _stopped_counts(job: Job) -> dict[str, int]:
    """Records the job's cancel or deadline stopped before they ran, by Batchery's error code."""
    counts = {"cancelled": 0, "expired": 0}
    for codes in job.shards.filter(round=0).values_list("error_codes", flat=True):
        for code in counts:
            counts[code] += int((codes or {}).get(code, 0))
    return counts


def request_counts(batch: MessageBatch) -> dict[str, int]:
    """Anthropic's tallies: every request `processing` until the batch has ended, as Anthropic counts them."""
    counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    job = batch.job
    if processing_status(batch) != "ended":
        counts["processing"] = batch.request_count
        return counts
    if job is None or not job.shard_count:
        # No output at all: cancelled or expired before it was planned, refused by its planner, deleted, or none
        # (no request of the batch could run).
        counts[_unrun_outcome(job)] = batch.request_count
        return counts
    stopped = _stopped_counts(job)
    counts.update(succeeded=job.succeeded_records, canceled=stopped["cancelled"], expired=stopped["expired"])
    counts["errored"] = max(0, job.failed_records - stopped["cancelled"] - stopped["expired"])
    return counts


def _unrun_outcome(job: Job | None) -> str:
    """What every request of a batch whose job ran none of them counts as."""
    if job is not None and job.status == JobStatus.CANCELLED:
        return "canceled"
    if job is not None and job.status == JobStatus.EXPIRED:
        return "expired"
    return "errored"


def _rfc3339(moment: dt.datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


def results_url(batch: MessageBatch, request: Request | None) -> str:
    """The results endpoint of the batch: absolute where the request tells the host, else the path."""
    path = reverse("anthropic:message-batch-results", kwargs={"batch_id": batch.id})
    return request.build_absolute_uri(path) if request is not None else path


def message_batch_object(batch: MessageBatch, *, request: Request | None = None) -> dict[str, Any]:
    """The batch as Anthropic's `MessageBatch` object."""
    status = processing_status(batch)
    job = batch.job
    reached = dict(job_steps(job)) if job is not None else {}
    ended = status == "ended"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": request_counts(batch),
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at),
        "ended_at": _rfc3339((job.finished_at if job is not None else None) or batch.created_at) if ended else None,
        "cancel_initiated_at": _rfc3339(reached.get(JobStatus.CANCELLING) or reached.get(JobStatus.CANCELLED)),
        "archived_at": None,
        "results_url": results_url(batch, request) if ended else None,
    }


def message_batch_results(batch: MessageBatch) -> Iterator[bytes]:
    """The results of an ended batch, one JSONL line a request, in request order.

    The source is opened here, so that a missing object raises `StorageError` before the first line; the
    lines are read and converted as the iterator is consumed.
    """
    job = batch.job
    model = _model_name(batch)
    if job is not None and job.shard_count:
        source = store_for(job.output_uri).open_read(job.output_uri)
        return _converted(source, batch.id, model)
    # Nothing ran: every request has the same result, one line each (their custom_ids read off the job's input),
    # but that an errored request refused at creation says why.
    input_uri = job.input_uri if job is not None else message_batch_input(batch.id)
    outcome = _unrun_outcome(job)
    if outcome == "errored":
        reason = tenant_job_error(job) if job is not None and job.error else "the batch's job ran no request"
        result = errored("invalid_request_error", reason)
    else:
        result = {"type": outcome}
    return _unrun(store_for(input_uri).open_read(input_uri), result)


def _model_name(batch: MessageBatch) -> str:
    return batch.job.model.name if batch.job is not None else ""


def _lines(source: BinaryIO) -> Iterator[bytes]:
    with source:
        for raw in source:
            if raw.strip():
                yield raw


def _converted(source: BinaryIO, batch_id: str, model: str) -> Iterator[bytes]:
    for raw in _lines(source):
        yield result_line(orjson.loads(raw), batch_id=batch_id, model=model)


def _unrun(source: BinaryIO, result: dict[str, Any]) -> Iterator[bytes]:
    for raw in _lines(source):
        record = orjson.loads(raw)
        refused = record.get(REFUSED_FIELD)
        own = errored("invalid_request_error", refused) if refused and result["type"] == "errored" else result
        yield orjson.dumps({"custom_id": record["custom_id"], "result": own}, option=orjson.OPT_APPEND_NEWLINE)
