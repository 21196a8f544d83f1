"""Fair share: in which order the waiting shards of several tenants go to one GPU class.

Each tenant's GPU-seconds on a class decay with a half-life, so the scheduler looks at recent use
(Slurm's fair-share factor): a tenant that used little lately goes first. The next shard goes to
the tenant with the lowest usage / weight among those with work waiting, and its estimated cost is
charged at once (start-time fair queuing), so shards in flight count before they finish and a burst
of free places is shared out in proportion to the weights. Within a tenant the job of the highest
priority goes first, then the oldest. Pure functions; `portal.execution.decayed_usage` keeps the ledger.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field


def decayed(usage: float, elapsed_s: float, half_life_s: float) -> float:
    """`usage` after `elapsed_s` seconds of exponential decay."""
    if elapsed_s <= 0:
        return usage
    return usage * math.exp2(-elapsed_s / half_life_s)


@dataclass
class WaitingJob:
    job_id: str
    priority: int
    """0-9; the job's effective priority (at most its tenant's)."""
    created_at: float
    pending: int
    """Shards not yet sent."""
    shard_cost: float
    """Estimated GPU-seconds of its longest waiting shard, which stands for each of its next ones."""


@dataclass
class TenantQueue:
    tenant_id: int
    weight: float
    usage: float
    """Decayed GPU-seconds on this class, now."""
    jobs: list[WaitingJob] = field(default_factory=list)


def share_out(free: int, tenants: list[TenantQueue]) -> tuple[Counter[str], dict[int, float]]:
    """Choose `free` shards: how many of each job's to send, and the GPU-seconds charged to each tenant."""
    chosen: Counter[str] = Counter()
    charged: dict[int, float] = defaultdict(float)
    heap: list[tuple[float, float, int, TenantQueue]] = []
    for tenant in tenants:
        tenant.jobs.sort(key=lambda job: (-job.priority, job.created_at, job.job_id))
        if any(job.pending > 0 for job in tenant.jobs):
            heap.append((tenant.usage / tenant.weight, -tenant.weight, tenant.tenant_id, tenant))
    heapq.heapify(heap)
    while free > 0 and heap:
        _, _, _, tenant = heapq.heappop(heap)
        job = next(job for job in tenant.jobs if job.pending > chosen[job.job_id])
        chosen[job.job_id] += 1
        charged[tenant.tenant_id] += job.shard_cost
        tenant.usage += job.shard_cost
        free -= 1
        if any(job.pending > chosen[job.job_id] for job in tenant.jobs):
            heapq.heappush(heap, (tenant.usage / tenant.weight, -tenant.weight, tenant.tenant_id, tenant))
    return chosen, charged
