"""A tenant's monthly budget (`Quota.monthly_budget`) held against what its jobs are expected to cost.

What a tenant has spent in a month is what its ledger lines of the month cost (`portal.jobs.billing`)
plus what its jobs not yet ended hold: each job submitted (or retried) under a budget holds its dry
run's hold (`CostEstimate.hold`: the whole input, the output its params allow, the dearest price) in a
`BudgetHold` until it ends and its ledger line counts instead. A job whose hold passes the budget less
that spend is refused at submission or retry, with the quota row locked so that two requests cannot
both take the last of it; a running job that reaches the budget is stopped (`budget_reached`).
Budgets are in the deployment's currency.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.catalog.money import ZERO, to_minor_unit
from portal.jobs.billing import job_cost_so_far, kept_costs
from portal.jobs.cost_estimate import cost_estimate
from portal.jobs.models import FINAL_STATUSES, Job, JobUsage, ShardStatus
from portal.jobs.quota import QuotaExceeded
from portal.jobs.usage import month_of
from portal.tenancy.models import BudgetHold, Quota

QUOTA = "monthly_budget"


@dataclass(frozen=True)
class BudgetLine:
    """The budget held against one job, as the dry run shows it and submission judges it."""

    limit: Decimal
    spent: Decimal
    """This month's ledger lines' cost plus the holds of the tenant's jobs not ended."""
    adds: Decimal
    """What the job holds (`CostEstimate.hold`)."""
    currency: str

    @property
    def left(self) -> Decimal:
        """What would be left with the job counted; below 0: over the budget."""
        return self.limit - self.spent - self.adds

    @property
    def refused(self) -> str | None:
        if self.left >= 0:
            return None
        return (
            f"quota {QUOTA} exceeded: budget {self.limit} {self.currency}, spent {self.spent:.2f} this month "
            f"(ended jobs and the holds of jobs not ended), this job holds {self.adds}"
        )

    def exceeded(self) -> QuotaExceeded:
        return QuotaExceeded(
            quota=QUOTA,
            limit=str(self.limit),
            current=f"{self.spent:.2f}",
            requested=str(self.adds),
            message=self.refused or "",
        )


def month_spend(tenant_id: int, *, excluding: Any = None) -> Decimal:
    """What the tenant's jobs have spent this month: its ledger lines' costs and its open holds; `excluding`,
    a job id, leaves that job's hold out (its lines stay: what its rounds that ended this month cost is spent)."""
    lines = kept_costs(JobUsage.objects.filter(tenant_id=tenant_id, period=month_of(timezone.now())))
    settled = to_minor_unit(lines.aggregate(total=Sum("cost"))["total"] or ZERO, settings.BATCHERY_CURRENCY)
    open_jobs = Job.objects.filter(tenant_id=tenant_id).exclude(status__in=FINAL_STATUSES).exclude(pk=excluding)
    held = BudgetHold.objects.filter(tenant_id=tenant_id, job_id__in=open_jobs.values("id")).aggregate(
        total=Sum("amount")
    )
    return settled + (held["total"] or ZERO)


def budget_reached(job: Job) -> str | None:
    """Why a running job must stop at its tenant's monthly budget; None: it may go on (or no budget is set).

    Reached when the rest of the month's spend (the ledger lines, this job's earlier rounds' among them where
    they ended this month, and other jobs' holds), what the round it runs has settled so far (at today's
    prices) and the estimated seconds of its shards still running (at the dearest of its prices) come to the
    budget: its hold was a forecast, and a job that costs more than forecast stops there instead of running
    the tenant past its budget. An earlier round that ended in an earlier month is that month's, not this
    one's."""
    limit = Quota.objects.filter(tenant_id=job.tenant_id).values_list("monthly_budget", flat=True).first()
    if limit is None:
        return None
    others = month_spend(job.tenant_id, excluding=job.pk)
    own = job_cost_so_far(job, round_=job.retry_round) + _in_flight(job)
    if others + own < limit:
        return None
    return (
        f"quota {QUOTA} reached: budget {limit} {settings.BATCHERY_CURRENCY}, spent {others:.2f} this month "
        f"before this round and {own:.2f} by this one (its shards still running estimated)"
    )


def _in_flight(job: Job) -> Decimal:
    """What the job's shards sent and not yet settled are expected to cost: their estimated GPU-seconds."""
    seconds = job.shards.filter(status=ShardStatus.DISPATCHED, round=job.retry_round).aggregate(
        total=Coalesce(Sum("estimated_seconds"), 0.0)
    )["total"]
    if not seconds:
        return ZERO
    adapter_ids = [int(entry["id"]) for entry in job.adapters.values()]
    return cost_estimate(
        model=job.model,
        adapter_ids=adapter_ids,
        gpu_seconds=seconds * job.model.gpus_per_replica,
        input_tokens=0,
        records=0,
        params={},
    ).hold


def budget_line(quota: Quota, *, hold: Decimal) -> BudgetLine | None:
    """The tenant's budget held against a job that holds `hold`; None: the quota sets no budget."""
    if quota.monthly_budget is None:
        return None
    return BudgetLine(
        limit=quota.monthly_budget,
        spent=month_spend(quota.tenant_id),
        adds=hold,
        currency=settings.BATCHERY_CURRENCY,
    )


def budget_reserve(quota: Quota, *, job_id: str | uuid.UUID, hold: Decimal) -> None:
    """Hold `hold` for the job against the budget of `quota`, whose row the caller has locked; raise
    `QuotaExceeded` where it does not fit. A quota without a budget holds nothing."""
    line = budget_line(quota, hold=hold)
    if line is None:
        return
    if line.refused is not None:
        raise line.exceeded()
    # A retry round's hold replaces the one its job held at submission (one hold a job, counted while it runs).
    BudgetHold.objects.update_or_create(job_id=job_id, defaults={"tenant_id": quota.tenant_id, "amount": hold})
