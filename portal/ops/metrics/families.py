"""Every control-side metric kept in the database: its name, type, help text, labels and buckets.

Gauges are not here: they are read at scrape time (`portal.ops.metrics.collector`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    """Prometheus family name; counters' samples add `_total`, histograms' `_bucket`, `_sum`, `_count`."""
    kind: str
    """`counter` or `histogram`."""
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    """Histogram upper bounds, +Inf excluded."""

    def sample(self, suffix: str = "") -> str:
        return f"{self.name}{suffix or ('_total' if self.kind == 'counter' else '')}"


# Seconds from a minute to a day: batch jobs run for minutes to hours.
JOB_SECONDS_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
QUEUE_WAIT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

JOBS_FINISHED = Family(
    "batchery_jobs_finished", "counter", "Jobs that reached an ending, by ending.", ("tenant", "model", "status")
)
RECORDS_FINISHED = Family(
    "batchery_records_finished",
    "counter",
    "Records whose job (or retry round) ended, by outcome: succeeded or the error code.",
    ("tenant", "model", "outcome"),
)
POISON_RECORDS = Family(
    "batchery_poison_records", "counter", "Records quarantined as poison_record (they killed their worker).",
    ("tenant", "model"),
)  # fmt: skip
GPU_SECONDS = Family(
    "batchery_gpu_seconds",
    "counter",
    "GPU-seconds charged to the tenant's ended jobs (load plus compute, times GPUs per replica).",
    ("tenant", "model", "gpu_class"),
)
SHARDS_REDISPATCHED = Family(
    "batchery_shards_redispatched", "counter", "Shards sent again (message lost, worker lost, task killed).",
    ("tenant", "model"),
)  # fmt: skip
JOB_DURATION = Family(
    "batchery_job_duration_seconds", "histogram", "Submission to ending, per ended job.", ("tenant", "model"),
    JOB_SECONDS_BUCKETS,
)  # fmt: skip
JOB_QUEUE_WAIT = Family(
    "batchery_job_queue_wait_seconds", "histogram", "Submission to the start of the job's first shard.",
    ("tenant", "model"), QUEUE_WAIT_BUCKETS,
)  # fmt: skip

STORED = (
    JOBS_FINISHED,
    RECORDS_FINISHED,
    POISON_RECORDS,
    GPU_SECONDS,
    SHARDS_REDISPATCHED,
    JOB_DURATION,
    JOB_QUEUE_WAIT,
)
