"""A tenant's quota held against its jobs: what its jobs use now, each limit's verdict on a job (the same
lines for a submission and a dry run), the reservation at submission, and the room left for the records of
a job that were not counted at submission, which its planner holds it to.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from django.db.models import Count, Sum
from django.utils import timezone

from portal.jobs.models import FINAL_STATUSES, Job, JobUsage
from portal.jobs.requests import SubmissionError
from portal.jobs.usage import month_of
from portal.tenancy.models import Quota, Tenant
from tasks.shared.formats.compression import DecompressionLimits

INPUT_BYTES_QUOTA = "quota max_input_bytes"
"""How a decompression refusal names the quota on input bytes."""


def exceeded_message(quota: str, limit: object, current: object, requested: object) -> str:
    return f"quota {quota} exceeded: limit {limit}, in use {current}, this job needs {requested}"


class QuotaExceeded(SubmissionError):
    """A limit of the tenant's quota refuses the job: `limit` is the limit, `current` the use so far."""

    def __init__(
        self,
        *,
        quota: str,
        limit: float | str | list[str],
        current: float | str,
        requested: float | str,
        message: str = "",
    ) -> None:
        super().__init__(message or exceeded_message(quota, limit, current, requested), field=quota)
        self.quota = quota
        self.limit = limit
        self.current = current
        self.requested = requested

    @property
    def may_pass_later(self) -> bool:
        """Whether the same job may be accepted once other jobs end: true of the limits on what runs at
        once; the others refuse the job itself (its size, its model) or hold for the rest of the month."""
        return self.quota in ("max_concurrent_jobs", "max_queued_records")


@dataclass(frozen=True)
class QuotaUsage:
    """What a tenant's jobs hold now of the quotas that bound them: the one definition that
    submission checks, the portal shows and /metrics exports."""

    concurrent_jobs: int
    """Jobs not yet ended."""
    queued_records: int
    """Records of those jobs (as far as they are known)."""
    gpu_seconds_this_month: float
    """GPU-seconds of the tenant's jobs that ended this month."""


def quota_usage(*, tenant_ids: Collection[int]) -> dict[int, QuotaUsage]:
    """Each tenant's quota usage, in two grouped queries whatever the number of tenants."""
    ids = list(tenant_ids)
    active: dict[int, tuple[int, int]] = {
        tenant_id: (jobs, records or 0)
        for tenant_id, jobs, records in Job.objects.filter(tenant_id__in=ids)
        .exclude(status__in=FINAL_STATUSES)
        .values("tenant_id")
        .annotate(jobs=Count("id"), records=Sum("total_records"))
        .values_list("tenant_id", "jobs", "records")
    }
    gpu_seconds = dict(
        JobUsage.objects.filter(tenant_id__in=ids, period=month_of(timezone.now()))
        .values("tenant_id")
        .annotate(total=Sum("gpu_seconds"))
        .values_list("tenant_id", "total")
    )
    return {
        tenant_id: QuotaUsage(
            concurrent_jobs=active.get(tenant_id, (0, 0))[0],
            queued_records=active.get(tenant_id, (0, 0))[1],
            gpu_seconds_this_month=float(gpu_seconds.get(tenant_id) or 0.0),
        )
        for tenant_id in ids
    }


@dataclass(frozen=True)
class QuotaLine:
    """One limit of a tenant's quota held against a job, as `job_submit` judges it."""

    quota: str
    """The limit's name, a field of `Quota`."""
    limit: int
    used: float
    """The use so far: jobs not ended, their records, this month's GPU-seconds; 0 for a per-job limit."""
    adds: float | None
    """What the job adds; None: not counted at submission (a large input's records), so not limited."""
    refused: str | None
    """Why `job_submit` refuses the job on this limit; None: the job fits."""

    @property
    def left(self) -> float | None:
        """What would be left with the job counted; below 0: over the limit."""
        return None if self.adds is None else self.limit - self.used - self.adds

    def exceeded(self) -> QuotaExceeded:
        requested = self.adds if self.adds is not None else 0
        return QuotaExceeded(
            quota=self.quota, limit=self.limit, current=self.used, requested=requested, message=self.refused or ""
        )


def quota_lines(
    quota: Quota, use: QuotaUsage, *, input_bytes: int, records: int | None, gpu_seconds: float = 0
) -> list[QuotaLine]:
    """Each set limit of `quota` held against a job of `input_bytes` and `records` (None: not counted
    at submission) that is expected to take `gpu_seconds`.

    The monthly GPU-seconds refuse a job only once they are used up: a job's cost is known when it
    ends, so a job that starts within the month may take it past the limit.
    """
    lines: list[QuotaLine] = []
    if (limit := quota.max_input_bytes) is not None:
        lines.append(_quota_line("max_input_bytes", limit, used=0, adds=input_bytes, over=input_bytes > limit))
    if (limit := quota.max_concurrent_jobs) is not None:
        over = use.concurrent_jobs + 1 > limit
        lines.append(_quota_line("max_concurrent_jobs", limit, used=use.concurrent_jobs, adds=1, over=over))
    if (limit := quota.gpu_seconds_per_month) is not None:
        used = use.gpu_seconds_this_month
        exhausted = f"quota gpu_seconds_per_month exhausted: limit {limit}, used {used:.1f} this month"
        lines.append(
            _quota_line(
                "gpu_seconds_per_month",
                limit,
                used=round(used, 1),
                adds=gpu_seconds,
                over=used >= limit,
                message=exhausted,
            )
        )
    if (limit := quota.max_queued_records) is not None:
        over = records is not None and use.queued_records + records > limit
        lines.append(_quota_line("max_queued_records", limit, used=use.queued_records, adds=records, over=over))
    return lines


def _quota_line(
    name: str, limit: int, *, used: float, adds: float | None, over: bool, message: str | None = None
) -> QuotaLine:
    refused = (message or exceeded_message(name, limit, used, adds)) if over else None
    return QuotaLine(quota=name, limit=limit, used=used, adds=adds, refused=refused)


def _locked_quota(tenant: Tenant) -> Quota:
    """The tenant's quota row, locked until the transaction ends (made if it has none)."""
    quota = Quota.objects.select_for_update().filter(tenant=tenant).first()
    if quota is None:
        Quota.objects.get_or_create(tenant=tenant)
        quota = Quota.objects.select_for_update().get(tenant=tenant)
    return quota


def quota_reserve(tenant: Tenant, *, input_bytes: int, records: int | None) -> Quota:
    """Hold a job against the tenant's limits with its quota row locked, so that concurrent submissions
    queue up here; raise `QuotaExceeded` on the first limit it passes. Returns the row, locked until the
    caller's transaction ends (`portal.jobs.budget.budget_reserve` holds the job's cost against it)."""
    quota = _locked_quota(tenant)
    use = quota_usage(tenant_ids=[tenant.pk])[tenant.pk]
    for line in quota_lines(quota, use, input_bytes=input_bytes, records=records):
        if line.refused is not None:
            raise line.exceeded()
    return quota


def quota_hold_pending(tenant: Tenant, *, pending: Callable[[], int], what: str) -> None:
    """Hold one more request that becomes a job only later (`what`, e.g. an OpenAI batch whose input file
    is still being validated) against `max_concurrent_jobs`, beside the tenant's jobs not ended and its
    other such requests (`pending`, counted with the quota row locked, so that concurrent requests queue
    up here). Raises `QuotaExceeded`; the caller's transaction keeps the lock until the request is saved."""
    quota = _locked_quota(tenant)
    limit = quota.max_concurrent_jobs
    if limit is None:
        return
    jobs = quota_usage(tenant_ids=[tenant.pk])[tenant.pk].concurrent_jobs
    held = jobs + pending()
    if held + 1 > limit:
        raise QuotaExceeded(
            quota="max_concurrent_jobs",
            limit=limit,
            current=held,
            requested=1,
            message=f"quota max_concurrent_jobs exceeded: limit {limit}, in use {held} ({jobs} jobs not ended, "
            f"{held - jobs} {what}), this needs 1",
        )


class RecordsOverQuota(Exception):
    """The records read so far do not fit in the tenant's `max_queued_records`."""


@dataclass(frozen=True)
class RecordsRoom:
    """What `max_queued_records` leaves a job whose records were not counted at submission."""

    limit: int
    used: int
    """Records of the tenant's other jobs not ended; the job itself counts none until it is planned."""

    def check(self, records: int) -> None:
        if self.used + records > self.limit:
            raise RecordsOverQuota(exceeded_message("max_queued_records", self.limit, self.used, f"at least {records}"))


def records_room(job: Job) -> RecordsRoom | None:
    """The room left under the tenant's `max_queued_records`; None: no such limit, or the job's records
    were counted (and held to it) at submission.

    Read once, when planning starts: two large jobs of a tenant planned at the same moment may each
    fit alone and not together, as two submissions would if the quota row were not locked."""
    if job.total_records is not None:
        return None
    limit = Quota.objects.filter(tenant_id=job.tenant_id).values_list("max_queued_records", flat=True).first()
    if limit is None:
        return None
    return RecordsRoom(limit=limit, used=quota_usage(tenant_ids=[job.tenant_id])[job.tenant_id].queued_records)


def input_limits(tenant_id: int) -> DecompressionLimits:
    """How far the tenant's compressed inputs may expand: the operator's limits, the most bytes lowered
    to the tenant's `max_input_bytes` where that is lower, so that the quota counts decompressed bytes."""
    quota_bytes = Quota.objects.filter(tenant_id=tenant_id).values_list("max_input_bytes", flat=True).first()
    return DecompressionLimits.configured().capped(quota_bytes, setting=INPUT_BYTES_QUOTA)


def input_bytes_exceeded(limit: int, message: str) -> QuotaExceeded:
    """The refusal of an input that decompresses past the tenant's `max_input_bytes`."""
    return QuotaExceeded(
        quota="max_input_bytes", limit=limit, current=0, requested=f"more than {limit}", message=message
    )
