"""A re-run's comparison report: computed from both outputs once both jobs have ended with an output,
written beside the re-run's output (`comparison.json`), and read from there after, until a retry round of
either job rewrites its output (the report names each job's round).

The merge that ends a re-run sends a task that writes it (`job_comparison_write`, on the planning lane:
one pass over both outputs in bounded memory, `portal.jobs.comparison`), so the first to ask reads a
file. A read that finds none (the message was lost, the worker died, the job it re-runs ended later)
computes it itself: a crash mid-computation leaves no state to resume, the file is written whole or not
at all, and two writers racing write the same bytes.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import orjson
from django.conf import settings
from django.utils import timezone

from portal.jobs.comparison.pairs import OutputsDiffer
from portal.jobs.comparison.report import ComparisonLimits, compare_outputs
from portal.jobs.models import COMPARABLE_ENDINGS, Job
from portal.jobs.storage_layout import comparison_uri, job_root
from tasks.shared.storage import StorageError, store_for

logger = logging.getLogger(__name__)


class NotARerun(Exception):
    """The job re-runs no job (or the job it re-ran is gone): it has no comparison."""


class ComparisonNotReady(Exception):
    """The comparison cannot be made now: a job has not ended, or ended without an output to compare (failed,
    cancelled, expired), or an output is unreadable; the message says which."""


def job_comparison(*, job: Job, now: dt.datetime | None = None) -> dict[str, Any]:
    """The report of the re-run `job` against the job it re-runs (docs/api.md, "Re-run and compare").

    Raises `NotARerun` for a job that re-runs none, `ComparisonNotReady` while it cannot be made."""
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
        report = _report(job, old, now=now or timezone.now())
        with store.open_write(uri) as target:
            target.write(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    except (StorageError, OSError) as exc:
        raise ComparisonNotReady(f"the outputs cannot be read: {exc}") from exc
    except OutputsDiffer as exc:
        raise ComparisonNotReady(f"the outputs are not of one input: {exc}") from exc
    logger.info("job %s: comparison against job %s written to %s", job.id, old.id, uri)
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


def job_comparison_write(*, job_id: str) -> None:
    """Write the re-run's report now, where it can be made (the comparison task); a job that is no re-run,
    or one not ready (the job it re-runs has not ended), is left to the first read."""
    job = Job.objects.select_related("model", "rerun_of__model").get(pk=job_id)
    try:
        job_comparison(job=job)
    except (NotARerun, ComparisonNotReady) as exc:
        logger.info("job %s: no comparison written now: %s", job_id, exc)
