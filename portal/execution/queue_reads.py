"""What a scheduling tick reads of its queue under the queue's lock, each in one statement: the shards in
flight with whether a long shard waits (`window_reading`), and the jobs with shards waiting that it may
choose from (`queue_waiting`)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count, Max

from portal.execution.dispatch import priority_for
from portal.jobs.models import SCHEDULABLE, Job, ShardStatus
from portal.jobs.selectors import queue_shards
from tasks.shared.config import queue_readings


def long_shard_seconds() -> float:
    """The shortest shard that gets a slot's least places (`capacity.shards_per_slot`): a queue with a
    shard this long waiting has its smallest window, whatever its other shards' lengths."""
    return settings.BATCHERY_SCHEDULER_SECONDS_AHEAD / settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT


def window_reading(queue: str, long_seconds: float) -> tuple[int, bool]:
    """The queue's shards sent and not ended (at most its window, counted through the unsettled index),
    and whether a shard of at least `long_seconds` waits: in one statement, which is most of what a tick
    of a full queue asks (a busy fleet's usual tick)."""
    in_flight = queue_shards(queue).filter(status=ShardStatus.DISPATCHED).values("pk")
    long_waiting = queue_shards(queue).filter(status=ShardStatus.PENDING, estimated_seconds__gte=long_seconds)
    in_flight_sql, in_flight_params = in_flight.query.sql_with_params()
    long_sql, long_params = long_waiting.values("pk")[:1].query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT (SELECT count(*) FROM ({in_flight_sql}) f), EXISTS ({long_sql})",
            (*in_flight_params, *long_params),
        )
        count, waiting = cursor.fetchone()
    return count, bool(waiting)


_WAITING_SQL = """
SELECT x.id, x.tenant_id, x.weight, x.priority, x.tenant_priority, x.created_at, x.gpu_class_id,
       x.gpus_per_replica, w.n, w.longest
FROM (
    SELECT j.id, j.tenant_id, t.weight, j.priority, t.priority AS tenant_priority, j.created_at,
           m.gpu_class_id, m.gpus_per_replica,
           row_number() OVER (
               PARTITION BY j.tenant_id
               ORDER BY LEAST(COALESCE(j.priority, t.priority), t.priority) DESC, j.created_at, j.id
           ) AS place
    FROM jobs_job j
    JOIN tenancy_tenant t ON t.id = j.tenant_id
    JOIN catalog_model m ON m.id = j.model_id
    JOIN catalog_gpuclass g ON g.id = m.gpu_class_id
    WHERE j.status = ANY(%(statuses)s) AND ({served})
      AND EXISTS (SELECT 1 FROM jobs_shard p WHERE p.job_id = j.id AND p.status = %(pending)s)
) x
CROSS JOIN LATERAL (
    SELECT count(*) AS n, max(f.estimated_seconds) AS longest FROM (
        SELECT s.estimated_seconds FROM jobs_shard s
        WHERE s.job_id = x.id AND s.status = %(pending)s ORDER BY s.index LIMIT %(cap)s
    ) f
) w
WHERE x.place <= %(cap)s
"""
_WAITING_FIELDS = (
    "id",
    "tenant_id",
    "tenant__weight",
    "priority",
    "tenant__priority",
    "created_at",
    "model__gpu_class_id",
    "model__gpus_per_replica",
)


def queue_waiting(queue: str, *, cap: int) -> list[Waiting]:
    """The queue's jobs with shards waiting that a tick sending at most `cap` shards may choose: each
    tenant's first `cap` of them in the order `share_out` takes a tenant's jobs (priority, then age), with
    how many shards each has waiting (at most `cap`) and the longest estimate of those first `cap`.

    Read in one statement, a look at the unsettled shards' index a job and `cap` rows of it for the jobs
    kept: an aggregate over every waiting shard grew with the backlog (a tenth of a second a tick with a
    hundred thousand shards waiting), and deciding between every waiting job of every tenant, where a
    tick fills one place, cost as much again."""
    readings = queue_readings(queue)
    if connection.vendor != "postgresql" or not readings:
        pending = (
            queue_shards(queue)
            .filter(status=ShardStatus.PENDING)
            .values("job_id")
            .annotate(n=Count("id"), longest=Max("estimated_seconds"))
        )
        figures = {str(row["job_id"]): (row["n"], row["longest"]) for row in pending}
        jobs = Job.objects.filter(pk__in=list(figures)).values_list(*_WAITING_FIELDS)
        rows = [(*job, *figures[str(job[0])]) for job in jobs]
    else:
        served = " OR ".join(
            f"(g.name = %(class{n})s AND m.gpus_per_replica = %(gpus{n})s)" for n in range(len(readings))
        )
        params: dict[str, Any] = {"statuses": list(SCHEDULABLE), "pending": ShardStatus.PENDING, "cap": cap}
        for n, (gpu_class, gpus) in enumerate(readings):
            params |= {f"class{n}": gpu_class, f"gpus{n}": gpus}
        with connection.cursor() as cursor:
            cursor.execute(_WAITING_SQL.format(served=served), params)
            rows = cursor.fetchall()
    return [
        Waiting(
            id=str(pk),
            tenant_id=tenant,
            weight=weight,
            priority=priority_for(job_priority, tenant_priority),
            created_at=created,
            gpu_class_id=gpu_class,
            gpus_per_replica=gpus,
            pending=min(n, cap),
            longest=longest,
        )
        for pk, tenant, weight, job_priority, tenant_priority, created, gpu_class, gpus, n, longest in rows
    ]


@dataclass(frozen=True)
class Waiting:
    """What a tick decides from of one job with shards waiting: read as plain values, not as a Job with its
    model and tenant, which cost most of a tick where hundreds of jobs wait."""

    id: str
    tenant_id: int
    weight: float
    priority: int
    created_at: dt.datetime
    gpu_class_id: int
    gpus_per_replica: int
    pending: int
    """Its shards waiting, or as many as the tick may send, if fewer."""
    longest: float | None
    """The longest estimate of those shards; None where none has one."""
