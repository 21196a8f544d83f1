"""Reads the portal's pages show: jobs with live figures, quota use, usage, shard grids, the fleet.

Every function takes the tenant (or a job already scoped to it): none reads across tenants.
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
from django.conf import settings
from django.db.models import F, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.catalog.money import ZERO, money
from portal.jobs.billing import cost_per_month
from portal.jobs.budget import month_spend
from portal.jobs.input_display import tenant_text
from portal.jobs.models import Job, JobAdapterUsage, JobEvent, JobStatus, JobUsage, Shard, ShardStatus
from portal.jobs.quota import quota_usage
from portal.jobs.selectors import (
    JobProgress,
    adapter_usage_per_month,
    job_progress,
    job_steps,
    usage_per_month,
)
from portal.ops.selectors import ClassSummary, fleet_classes, fleet_slots
from portal.tenancy.models import Quota, Tenant
from tasks.shared.leases import shard_lease_key
from tasks.shared.progress import read_shard_progress
from tasks.shared.redis_client import redis_client
from tasks.shared.storage import StorageError, store_for

ERROR_LINES_SHOWN = 20
THROUGHPUT_BUCKETS = 60
SHARD_STATE_LABELS = {"done": "done, waiting for the merge", "succeeded": "merged", "errors": "merged with errors"}


def job_percent(job: Job, progress: JobProgress) -> int:
    """Whole percent done; 100 only when every record has its line (a job of no records once ended)."""
    if progress.total == 0:
        return 100 if job.is_finished else 0
    return math.floor(progress.fraction * 100)


@dataclass(frozen=True)
class JobRow:
    """A job with its live figures, as the dashboard lists it."""

    job: Job
    progress: JobProgress
    percent: int
    elapsed: float | None
    """Seconds since the job started running (until it ended); None before it runs."""
    rate: float | None
    """Records per second over `elapsed`."""


def tenant_jobs(tenant: Tenant) -> QuerySet[Job]:
    """The tenant's jobs, newest first, with the moment each first started running as `running_at` (its
    planning's end, where retention removed its events)."""
    first_run = JobEvent.objects.filter(job=OuterRef("pk"), status=JobStatus.RUNNING).order_by("at").values("at")[:1]
    return (
        Job.objects.filter(tenant=tenant)
        .select_related("model", "created_by")
        .annotate(running_at=Coalesce(Subquery(first_run), F("started_at")))
        .order_by("-created_at")
    )


def _elapsed(job: Job) -> float | None:
    started: dt.datetime | None = getattr(job, "running_at", None)
    if started is None:
        return None
    ended = job.finished_at if job.is_finished and job.finished_at else timezone.now()
    return max(0.0, (ended - started).total_seconds())


def job_row(job: Job) -> JobRow:
    """`job` from `tenant_jobs`, with its progress (live from Redis while it runs) and rate."""
    progress = job_progress(job)
    elapsed = _elapsed(job)
    return JobRow(
        job=job,
        progress=progress,
        percent=job_percent(job, progress),
        elapsed=elapsed,
        rate=progress.done / elapsed if elapsed else None,
    )


def job_rows(jobs: Iterable[Job]) -> list[JobRow]:
    return [job_row(job) for job in jobs]


@dataclass(frozen=True)
class Limit:
    """One quota limit and the use against it."""

    name: str
    used: float
    limit: float | None
    """None: no limit."""

    @property
    def percent(self) -> int:
        if not self.limit:
            return 0
        return min(100, math.floor(100 * self.used / self.limit))

    @property
    def level(self) -> str:
        """ok, high or full: how close the use is to the limit, for colouring."""
        if self.limit is None:
            return "ok"
        if self.used >= self.limit:
            return "full"
        return "high" if self.percent >= 80 else "ok"


@dataclass(frozen=True)
class QuotaUse:
    concurrent_jobs: Limit
    queued_records: Limit
    gpu_seconds: Limit
    """This month's GPU-seconds."""
    max_input_bytes: int | None
    budget: Limit | None = None
    """This month's spend against the monthly budget (`portal.jobs.budget`), in whole units; None: no budget."""
    allowed_models: list[str] = field(default_factory=list)
    allowed_gpu_classes: list[str] = field(default_factory=list)


def quota_use(tenant: Tenant) -> QuotaUse:
    """The tenant's limits and what its jobs use of them now (GPU-seconds: this month)."""
    # A tenant made in the admin without a quota row has the defaults (`tenant_create` writes one).
    quota = Quota.objects.filter(tenant=tenant).first() or Quota(tenant=tenant)
    use = quota_usage(tenant_ids=[tenant.pk])[tenant.pk]
    return QuotaUse(
        concurrent_jobs=Limit("Concurrent jobs", use.concurrent_jobs, quota.max_concurrent_jobs),
        queued_records=Limit("Queued records", use.queued_records, quota.max_queued_records),
        gpu_seconds=Limit("GPU-seconds this month", use.gpu_seconds_this_month, quota.gpu_seconds_per_month),
        max_input_bytes=quota.max_input_bytes,
        budget=None
        if quota.monthly_budget is None
        else Limit(
            f"Budget this month ({settings.BATCHERY_CURRENCY})",
            float(month_spend(tenant.pk)),
            float(quota.monthly_budget),
        ),
        allowed_models=[str(model) for model in quota.allowed_models.all()] if quota.pk else [],
        allowed_gpu_classes=[gpu.name for gpu in quota.allowed_gpu_classes.all()] if quota.pk else [],
    )


def usage_by_month(tenant: Tenant) -> list[dict[str, Any]]:
    """The tenant's ledger summed per month, newest first, each month with its cost (`money`) in all and
    per model (`models`: name@version -> money)."""
    usage = JobUsage.objects.filter(tenant=tenant)
    costs = cost_per_month(usage)
    rows = []
    for row in usage_per_month(usage):
        period = costs.get(row["period"])
        rows.append(
            {
                **row,
                "cost": money(period.cost if period else ZERO),
                "models": {name: money(amount) for name, amount in (period.models.items() if period else ())},
            }
        )
    return rows


def adapter_usage_by_month(tenant: Tenant) -> list[dict[str, Any]]:
    """The per-adapter split of the tenant's ledger (the base model under its own name) summed per month and
    name, newest month first."""
    return [dict(row) for row in adapter_usage_per_month(JobAdapterUsage.objects.filter(usage__tenant=tenant))]


@dataclass(frozen=True)
class JobAdapter:
    """A LoRA adapter a job runs, as its page shows it."""

    name: str
    version: str
    rank: int
    default: bool
    """True for the adapter the job itself names; False for one only its records name."""


def job_adapters(job: Job) -> list[JobAdapter]:
    """The adapters the job runs (from `Job.adapters`), the one it names first, then by name."""
    found = [
        JobAdapter(
            name=str(entry["spec"]["name"]),
            version=str(entry["spec"]["version"]),
            rank=int(entry["spec"]["rank"]),
            default=bool(entry.get("default")),
        )
        for entry in job.adapters.values()
    ]
    return sorted(found, key=lambda adapter: (not adapter.default, adapter.name, adapter.version))


@dataclass(frozen=True)
class TimelineStep:
    status: str
    at: dt.datetime
    after: float | None
    """Seconds since the step before."""


def job_timeline(job: Job) -> list[TimelineStep]:
    steps: list[TimelineStep] = []
    for status, at in job_steps(job):
        after = (at - steps[-1].at).total_seconds() if steps else None
        steps.append(TimelineStep(status=status, at=at, after=after))
    return steps


@dataclass(frozen=True)
class ShardCell:
    """One shard of the grid: a state for its colour and a line for its tooltip."""

    index: int
    state: str
    """pending, queued, running, done, succeeded, errors, failed or stopped."""
    title: str


def _shard_live(job_id: str) -> dict[int, tuple[int, int]]:
    """Each running or finished shard's (done, failed) from the live progress counters."""
    return {index: (shard.done, shard.failed) for index, shard in read_shard_progress(job_id).items()}


def _running_workers(job_id: str, indexes: list[int]) -> dict[int, str]:
    """The worker running each of these shards now: the holder of its attempt's lease."""
    if not indexes:
        return {}
    try:
        holders = redis_client().mget([shard_lease_key(job_id, index) for index in indexes])
    except redis.RedisError:
        return {}
    workers = {}
    for index, holder in zip(indexes, holders, strict=True):
        if holder:
            # The holder is `<worker>:<attempt id>`.
            workers[index] = (holder.decode() if isinstance(holder, bytes) else str(holder)).rsplit(":", 1)[0]
    return workers


def _shard_state(job: Job, shard: Shard, live: tuple[int, int] | None, running: bool) -> str:
    if shard.status == ShardStatus.SUCCEEDED:
        return "errors" if shard.failed_records else "succeeded"
    if shard.status == ShardStatus.FAILED:
        return "stopped" if job.status in (JobStatus.CANCELLED, JobStatus.EXPIRED) else "failed"
    if shard.status == ShardStatus.PENDING:
        return "pending"
    if live is not None and live[0] >= shard.record_count:
        return "done"
    return "running" if running or (live is not None and live[0] > 0) else "queued"


def _shard_title(job: Job, shard: Shard, state: str, live: tuple[int, int] | None, worker: str) -> str:
    parts = [f"Shard {shard.index}", SHARD_STATE_LABELS.get(state, state), f"attempt {shard.attempt}"]
    if worker:
        parts.append(f"worker {worker}")
    if shard.started_at and shard.finished_at:
        parts.append(f"{(shard.finished_at - shard.started_at).total_seconds():.1f} s")
    if shard.status == ShardStatus.SUCCEEDED:
        parts.append(f"{shard.succeeded_records + shard.failed_records} records ({shard.failed_records} failed)")
    elif live is not None:
        parts.append(f"{live[0]} of {shard.record_count} records")
    else:
        parts.append(f"{shard.record_count} records")
    if shard.error:
        parts.append(tenant_text(shard.error, job=job)[:200])
    return " · ".join(parts)


def shard_grid(job: Job) -> list[ShardCell]:
    """The shards of the job's current round, in order."""
    shards = list(job.shards.filter(round=job.retry_round).order_by("index"))
    dispatched = [shard.index for shard in shards if shard.status == ShardStatus.DISPATCHED]
    live = _shard_live(str(job.id)) if dispatched and not job.is_finished else {}
    workers = _running_workers(str(job.id), dispatched) if not job.is_finished else {}
    cells = []
    for shard in shards:
        figures = live.get(shard.index)
        state = _shard_state(job, shard, figures, running=shard.index in workers)
        worker = shard.worker or workers.get(shard.index, "")
        cells.append(ShardCell(index=shard.index, state=state, title=_shard_title(job, shard, state, figures, worker)))
    return cells


def throughput_history(job: Job) -> list[tuple[float, float]]:
    """Records per second over the run of an ended job, from its shards' timings: (seconds from the
    start, rate) per bucket. Each shard's records are spread evenly over the time it ran."""
    spans = [
        (shard.started_at.timestamp(), shard.finished_at.timestamp(), shard.succeeded_records + shard.failed_records)
        for shard in job.shards.exclude(started_at=None).exclude(finished_at=None)
        if shard.started_at and shard.finished_at
    ]
    if not spans:
        return []
    start = min(span[0] for span in spans)
    end = max(span[1] for span in spans)
    width = max((end - start) / THROUGHPUT_BUCKETS, 0.25)
    buckets = [0.0] * max(1, math.ceil((end - start) / width))
    for first, last, records in spans:
        seconds = max(last - first, 1e-6)
        for bucket in range(int((first - start) // width), min(len(buckets), int((last - start) // width) + 1)):
            low, high = start + bucket * width, start + (bucket + 1) * width
            overlap = max(0.0, min(high, last) - max(low, first))
            buckets[bucket] += records * overlap / seconds
    return [(round((n + 0.5) * width, 2), round(total / width, 1)) for n, total in enumerate(buckets)]


@dataclass(frozen=True)
class ErrorLine:
    custom_id: str
    code: str
    message: str


def error_lines(job: Job, limit: int = ERROR_LINES_SHOWN) -> list[ErrorLine]:
    """The first lines of an ended job's error file; none while it runs or if the file cannot be read."""
    if not job.is_finished or not job.errors_uri or not job.failed_records:
        return []
    lines = []
    try:
        with store_for(job.errors_uri).open_read(job.errors_uri) as stream:
            for raw in stream:
                data = orjson.loads(raw)
                error = data.get("error") or {}
                code, message = str(error.get("code", "")), str(error.get("message", ""))
                lines.append(ErrorLine(custom_id=str(data.get("custom_id")), code=code, message=message))
                if len(lines) >= limit:
                    break
    except (StorageError, orjson.JSONDecodeError):
        return lines
    return lines


@dataclass(frozen=True)
class Device:
    gpu: int
    utilization: int
    memory_used: int
    memory_total: int

    @property
    def memory_percent(self) -> int:
        return math.floor(100 * self.memory_used / self.memory_total) if self.memory_total else 0

    @property
    def memory_label(self) -> str:
        """31.5 / 80 GiB."""
        return f"{self.memory_used / 2**30:.1f} / {self.memory_total / 2**30:.0f} GiB"


@dataclass(frozen=True)
class SlotView:
    """One slot of the fleet as a tenant sees it: another tenant's shard is shown only as busy."""

    host: str
    slot: str
    gpu_class: str
    gpus: list[int]
    loaded_models: list[str]
    busy: bool
    own_job_id: str | None
    """The tenant's job the slot runs now, if it runs one of the tenant's."""
    own_shard: str
    devices: list[Device]
    age: float
    """Seconds since the last heartbeat."""


@dataclass(frozen=True)
class FleetView:
    slots: list[SlotView]
    """Every live slot, by host and slot."""
    classes: list[ClassSummary]
    """A line per GPU class, counting the slots that run the tenant's shards."""


def fleet_view(tenant: Tenant) -> FleetView:
    """Every live slot, with the shard it runs shown only if it is the tenant's, and a summary per class."""
    beats = fleet_slots()
    job_ids = {str(beat.get("current_shard") or "").partition("/")[0] for beat in beats} - {""}
    own = {str(pk) for pk in Job.objects.filter(tenant=tenant, pk__in=_uuids(job_ids)).values_list("pk", flat=True)}
    now = time.time()
    slots = []
    for beat in beats:
        job_id, _, index = str(beat.get("current_shard") or "").partition("/")
        devices = [
            Device(
                gpu=int(reading.get("gpu", 0)),
                utilization=int(reading.get("utilization", 0)),
                memory_used=int(reading.get("memory_used", 0)),
                memory_total=int(reading.get("memory_total", 0)),
            )
            for reading in beat.get("telemetry") or []
        ]
        slots.append(
            SlotView(
                host=str(beat.get("host", "")),
                slot=str(beat.get("slot", "")),
                gpu_class=str(beat.get("gpu_class", "")),
                gpus=list(beat.get("gpus") or []),
                loaded_models=list(beat.get("loaded_models") or []),
                busy=bool(job_id),
                own_job_id=job_id if job_id in own else None,
                own_shard=index if job_id in own else "",
                devices=devices,
                age=max(0.0, now - float(beat.get("at", now))),
            )
        )
    slots.sort(key=lambda slot: (slot.host, slot.gpu_class, slot.slot))
    return FleetView(slots=slots, classes=fleet_classes(beats, own_jobs=own))


def _uuids(values: Iterable[str]) -> list[str]:
    """The values that are UUIDs (a heartbeat is data from elsewhere; a bad one must not break the query)."""
    found = []
    for value in values:
        try:
            found.append(str(uuid.UUID(value)))
        except ValueError:
            continue
    return found
