"""Reads of jobs that pages, the API and the CLI share."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, F, Q, QuerySet, Sum

from portal.catalog.models import Model
from portal.jobs.models import SCHEDULABLE, Job, JobAdapterUsage, JobUsage, Shard
from portal.jobs.storage_layout import job_root, parquet_output_uri
from tasks.shared.config import queue_readings
from tasks.shared.progress import Progress, read_job_progress, read_jobs_progress


@dataclass(frozen=True)
class JobProgress:
    status: str
    total: int | None
    """Records in the job, once known."""
    done: int
    """Records finished, succeeded or failed."""
    failed: int

    @property
    def fraction(self) -> float:
        if not self.total:
            return 0.0
        return min(1.0, self.done / self.total)


def queue_jobs(queue: str, *, statuses: Collection[str], among: Collection[str] | None = None) -> list[Job]:
    """The jobs in `statuses` whose shards go to `queue` (of the ids `among`, where given), with their
    model, GPU class and tenant.

    Chosen by the database from the (GPU class, replica size) pairs the queue serves, so that a scheduling
    tick reads its own queue's jobs, not every running job of the fleet."""
    jobs = Job.objects.select_related("model__gpu_class", "tenant").filter(queue_filter(queue), status__in=statuses)
    return list(jobs if among is None else jobs.filter(pk__in=list(among)))


def queue_filter(queue: str, *, through: str = "") -> Q:
    """The condition on a job (reached from another model `through` a relation path, e.g. ``job__``)
    that its shards go to `queue`."""
    served = Q(**{f"{through}pk__in": []})
    for gpu_class, gpus in queue_readings(queue):
        served |= Q(**{f"{through}model__gpu_class__name": gpu_class, f"{through}model__gpus_per_replica": gpus})
    return served


def queue_shards(queue: str) -> QuerySet[Shard]:
    """The shards of the queue's schedulable jobs (planning or running): those its scheduler may send."""
    return Shard.objects.filter(queue_filter(queue, through="job__"), job__status__in=SCHEDULABLE)


def job_progress(job: Job, live: Progress | None = None) -> JobProgress:
    """Live figures from Redis while the job runs (`live` where the caller read them already, see
    `jobs_live_progress`); the database's once it has ended."""
    if job.is_finished:
        done = job.succeeded_records + job.failed_records
        return JobProgress(status=job.status, total=job.total_records, done=done, failed=job.failed_records)
    live = live or read_job_progress(str(job.id))
    return JobProgress(status=job.status, total=job.total_records, done=live.done, failed=live.failed)


def job_steps(job: Job) -> list[tuple[str, dt.datetime]]:
    """The job's status changes in order, as (status, when): from its events (prefetched ones too), or,
    once retention removed them, from the timeline it kept of them."""
    if job.pruned_at is not None:
        return [(status, dt.datetime.fromisoformat(at)) for status, at in job.timeline or []]
    return [(event.status, event.at) for event in sorted(job.events.all(), key=lambda event: (event.at, event.pk))]


def jobs_live_progress(jobs: Collection[Job]) -> dict[str, Progress]:
    """The live figures of the jobs not yet ended, by job id, in one Redis round trip: a list page
    would otherwise make one per running job."""
    return read_jobs_progress([str(job.id) for job in jobs if not job.is_finished])


def job_output_file(job: Job) -> tuple[str, str]:
    """The output a job asked for, as (URI, file name): its Parquet copy, or the JSONL."""
    if job.output_format == "parquet":
        return parquet_output_uri(job_root(job)), "output.parquet"
    return job.output_uri, "output.jsonl"


def usage_per_month(usage: QuerySet[JobUsage]) -> QuerySet[Any, Any]:
    """Ledger lines summed per month, newest first: jobs (each once, however many of its endings fell in the
    month), records, tokens in (and of them cached) and out, GPU-seconds."""
    return (
        usage.order_by()
        .values("period")
        .annotate(
            jobs=Count("job", distinct=True),
            records_succeeded=Sum("records_succeeded"),
            records_failed=Sum("records_failed"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cached_prompt_tokens=Sum("cached_prompt_tokens"),
            gpu_seconds=Sum("gpu_seconds"),
        )
        .order_by("-period")
    )


def adapter_usage_per_month(lines: QuerySet[JobAdapterUsage]) -> QuerySet[Any, Any]:
    """Ledger lines' per-adapter splits summed per month and name (``name@version``, or the base model's
    name), newest month first: jobs, records, tokens in and out."""
    return (
        lines.order_by()
        .values("name", period=F("usage__period"))
        .annotate(
            jobs=Count("usage__job", distinct=True),
            records_succeeded=Sum("records_succeeded"),
            records_failed=Sum("records_failed"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
        )
        .order_by("-period", "name")
    )


def model_weights_digest(model: Model) -> str:
    """The digest of the weights the model's last finished job ran on, by its manifest; "" where no job of the
    model has one yet."""
    jobs = Job.objects.filter(model=model, finished_at__isnull=False).exclude(provenance={})
    latest = jobs.order_by("-finished_at").values_list("provenance__model__weights_digest", flat=True).first()
    return str(latest or "")
