"""A re-run's comparison report: computed from both outputs once both jobs have ended with an output,
written beside the re-run's output (`comparison.json`), and read from there after, until a retry round of
either job rewrites its output (the report names each job's round).

The merge that ends a re-run sends a task that writes it (`job_comparison_write`, on the planning lane:
one pass over both outputs in bounded memory, `portal.jobs.comparison`), so the first to ask reads a
file. A read that finds none (the message was lost, the worker died, the job it re-runs ended later)
computes it itself where the re-run has at most BATCHERY_COMPARISON_INLINE_RECORDS records
(`job_comparison_read`), under the job's comparison lease, so parallel reads leave it to the first; past
that, a web request would hold a portal worker for as long as the outputs take to compare, so the read
asks the task again (unless one holds the job's comparison lease, or was asked a moment ago) and answers
that the report is being written (`ComparisonPending`), or, where the task found the outputs could not be
compared or ran out of time, why (`OutputsNotComparable`, kept REFUSAL_KEPT_S). A crash mid-computation
leaves no state to resume, the file is written whole or not at all, and two writers racing write the
same bytes.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
from typing import Any

import orjson
import redis
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.utils import timezone

from portal.jobs.comparison.pairs import OutputsDiffer
from portal.jobs.comparison.report import ComparisonLimits, compare_outputs
from portal.jobs.models import COMPARABLE_ENDINGS, Job
from portal.jobs.storage_layout import comparison_uri, job_root
from tasks import send
from tasks.shared.config import CONTROL_SOFT_TIME_LIMIT_S
from tasks.shared.leases import Lease, LeaseHeld, job_lease_key, lease_holder
from tasks.shared.redis_client import redis_client
from tasks.shared.storage import StorageError, store_for

logger = logging.getLogger(__name__)

ASKED_AGAIN_AFTER_S = 60
"""A read asks the comparison task at most once in this many seconds a job, while no task holds its lease."""
STARTS_BEFORE_REFUSAL = 3
"""Starts of the comparison task for a job (duplicates included) before one that finds no report refuses."""
REFUSAL_KEPT_S = 600
"""How long reads answer why the task could not compare a job's outputs before they ask it again (an outage of
storage passes)."""


class NotARerun(Exception):
    """The job re-runs no job (or the job it re-ran is gone): it has no comparison."""


class ComparisonPending(Exception):
    """The report of a re-run too large to compare within a read is being written by the comparison task."""


class ComparisonNotReady(Exception):
    """The comparison cannot be made now: a job has not ended, or ended without an output to compare (failed,
    cancelled, expired), or an output is unreadable; the message says which."""


class OutputsNotComparable(ComparisonNotReady):
    """The outputs cannot be compared: one cannot be read, or they are not of one input."""


def job_comparison_read(*, job: Job) -> dict[str, Any]:
    """`job_comparison` for a reader (the API, the portal): a report not written yet is computed within the
    read only for a re-run of at most BATCHERY_COMPARISON_INLINE_RECORDS records, and only by one reader
    at a time (the job's comparison lease: parallel reads of a report not yet written each did the work);
    for a larger one, or while another writes it, `ComparisonPending` is raised (the task asked first)."""
    holder = f"read@{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"
    try:
        return job_comparison(job=job, inline_records=settings.BATCHERY_COMPARISON_INLINE_RECORDS, holder=holder)
    except LeaseHeld as held:
        raise ComparisonPending(
            f"the comparison of job {job.id} with job {job.rerun_of_id} is being written; ask again in a moment"
        ) from held


def job_comparison(
    *, job: Job, now: dt.datetime | None = None, inline_records: int | None = None, holder: str | None = None
) -> dict[str, Any]:
    """The report of the re-run `job` against the job it re-runs (docs/api.md, "Re-run and compare").

    Raises `NotARerun` for a job that re-runs none, `ComparisonNotReady` while it cannot be made, and,
    where the report is not written and the re-run has more than `inline_records` records (None: no
    bound), `ComparisonPending` once it has asked the comparison task to write it. With a `holder`, a
    report not written is computed under the job's exclusive comparison lease (`LeaseHeld` while another
    holds it), so that one writer does the work."""
    old = job.rerun_of
    if old is None:
        raise NotARerun(f"job {job.id} is not a re-run of another job")
    for which, subject in (("re-run", job), ("job it re-runs", old)):
        if subject.status not in COMPARABLE_ENDINGS:
            raise ComparisonNotReady(
                f"the {which} (job {subject.id}) is {subject.status}: the comparison is made once both jobs "
                "have succeeded or partially succeeded"
            )
    uri = comparison_uri(job_root(job))
    store = store_for(uri)
    try:
        if store.exists(uri):
            report: dict[str, Any] = orjson.loads(store.read_bytes(uri))
            if _current(report, job, old):
                return report
        if inline_records is not None and (records := job.total_records or 0) > inline_records:
            if refusal := _refusal(job):
                raise OutputsNotComparable(refusal)
            _ask_task(job)
            raise ComparisonPending(
                f"the comparison of job {job.id}'s {records:,} records with job {old.id}'s is being written; "
                "ask again in a minute"
            )
        if holder is None:
            report = _write_report(job, old, uri, now=now)
        else:
            with Lease(job_lease_key("compare", str(job.id)), holder, exclusive=True):
                # The holder before this one may have written it while this one waited for the lease.
                if store.exists(uri) and _current(report := orjson.loads(store.read_bytes(uri)), job, old):
                    return report
                report = _write_report(job, old, uri, now=now)
    except (StorageError, OSError) as exc:
        raise OutputsNotComparable(f"the outputs cannot be read: {exc}") from exc
    except OutputsDiffer as exc:
        raise OutputsNotComparable(f"the outputs are not of one input: {exc}") from exc
    logger.info("job %s: comparison against job %s written to %s", job.id, old.id, uri)
    return report


def _write_report(job: Job, old: Job, uri: str, *, now: dt.datetime | None) -> dict[str, Any]:
    report = _report(job, old, now=now or timezone.now())
    with store_for(uri).open_write(uri) as target:
        target.write(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report


def _current(report: dict[str, Any], job: Job, old: Job) -> bool:
    """Whether a stored report is of the outputs as they are: a retry round since rewrote an output in place."""
    return all(
        report.get(side, {}).get("retry_round") == subject.retry_round for side, subject in (("old", old), ("new", job))
    )


def _side(job: Job) -> dict[str, Any]:
    return {
        "job": str(job.id),
        "model": job.model.name,
        "model_version": job.model.version,
        "params": job.params,
        "status": job.status,
        "retry_round": job.retry_round,
        "succeeded_records": job.succeeded_records,
        "failed_records": job.failed_records,
    }


def _report(job: Job, old: Job, *, now: dt.datetime) -> dict[str, Any]:
    limits = ComparisonLimits(
        neighbour_sample=settings.BATCHERY_COMPARISON_NEIGHBOUR_SAMPLE,
        max_vector_bytes=settings.BATCHERY_COMPARISON_VECTOR_BYTES,
        max_text_chars=settings.BATCHERY_COMPARISON_TEXT_CHARS,
    )
    figures = compare_outputs(
        old_uri=old.output_uri,
        new_uri=job.output_uri,
        task=job.model.task,
        records=job.total_records or 0,
        limits=limits,
    )
    return {
        "job": str(job.id),
        "rerun_of": str(old.id),
        "task": job.model.task,
        "computed_at": now.isoformat(),
        "old": _side(old),
        "new": _side(job),
        **figures,
    }


def _round_key(kind: str, job: Job) -> str:
    """A key of the job's comparison per retry round of either job (a round rewrites an output)."""
    old_round = job.rerun_of.retry_round if job.rerun_of is not None else 0
    return f"batchery:compare-{kind}:{job.id}:{old_round}:{job.retry_round}"


def _refusal_key(job: Job) -> str:
    """Where the comparison task leaves why it could not compare."""
    return _round_key("refused", job)


def _refusal(job: Job) -> str | None:
    """Why the comparison task last failed to compare the job's outputs, within REFUSAL_KEPT_S; None: it did not."""
    try:
        refusal = redis_client().get(_refusal_key(job))
    except redis.RedisError:
        return None
    return refusal.decode() if isinstance(refusal, bytes) else refusal


def _ask_task(job: Job) -> None:
    """Send the comparison task for the job, unless one holds its lease or a read asked a moment ago."""
    if lease_holder(job_lease_key("compare", str(job.id))) is not None:
        return
    try:
        asked = redis_client().set(f"batchery:compare-asked:{job.id}", 1, nx=True, ex=ASKED_AGAIN_AFTER_S)
    except redis.RedisError:
        asked = True  # a duplicate task only waits on the lease of the first
    if asked:
        send.send_comparison(str(job.id))


def job_comparison_write(*, job_id: str, worker: str) -> None:
    """Write the re-run's report now, where it can be made (the comparison task, run by `worker`), under the
    job's comparison lease: a second task for the job leaves it to the first. A job that is no re-run, or
    one not ready (the job it re-runs has not ended), is left to the first read."""
    job = Job.objects.select_related("model", "rerun_of__model").get(pk=job_id)
    started = _count_start(job)
    if started > STARTS_BEFORE_REFUSAL:
        # Killed each time (its hard time limit, out of memory), it was given back and ran again, and reads
        # past ASKED_AGAIN_AFTER_S asked for it again: answer why instead.
        _keep_refusal(
            job,
            f"the comparison task stopped {started - 1} times before it finished (past its time limit or out of "
            "memory)",
        )
        return
    try:
        job_comparison(job=job, holder=worker)
    except LeaseHeld as held:
        logger.info("job %s: its comparison is being written by %s", job_id, held.holder)
    except OutputsNotComparable as exc:
        _keep_refusal(job, str(exc))
    except SoftTimeLimitExceeded:
        # Else every read past ASKED_AGAIN_AFTER_S sent it again, to run out of time again.
        _keep_refusal(
            job,
            f"comparing the outputs took longer than the comparison task may run ({CONTROL_SOFT_TIME_LIMIT_S} s)",
        )
    except (NotARerun, ComparisonNotReady) as exc:
        logger.info("job %s: no comparison written now: %s", job_id, exc)


def _count_start(job: Job) -> int:
    """Count a start of the comparison task for the job (per retry round of either job, kept REFUSAL_KEPT_S);
    how many there were, this one included (1 without Redis)."""
    key = _round_key("started", job)
    try:
        with redis_client().pipeline() as pipe:
            pipe.incr(key)
            pipe.expire(key, REFUSAL_KEPT_S)
            count, _ = pipe.execute()
    except redis.RedisError:
        return 1
    return int(count)


def _keep_refusal(job: Job, refusal: str) -> None:
    """Keep why the task could not compare, for the reads of a large re-run, which leave the comparing to this
    task: they answer it (and ask again only after REFUSAL_KEPT_S)."""
    logger.warning("job %s: no comparison: %s", job.id, refusal)
    try:
        redis_client().set(_refusal_key(job), refusal, ex=REFUSAL_KEPT_S)
    except redis.RedisError:
        logger.warning("job %s: the comparison's refusal could not be kept", job.id)
