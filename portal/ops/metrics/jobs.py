"""What a job adds to the control side's metrics, written in the transaction that records it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from portal.jobs.models import Job, Shard
from portal.ops.metrics import families
from portal.ops.metrics.samples import Increment, counter_increment, histogram_increments, samples_add

POISON_RECORD = "poison_record"


def job_ending_record(*, job: Job, gpu_seconds_added: float) -> None:
    """Count a job's ending, read with its model, GPU class and tenant: the job, its round's records by
    outcome, how long it took and waited, and the GPU-seconds its ledger line added (all in one write)."""
    labels = {"tenant": job.tenant.name, "model": job.model.name}
    increments: list[Increment] = counter_increment(families.JOBS_FINISHED, {**labels, "status": job.status})
    increments += counter_increment(
        families.GPU_SECONDS, {**labels, "gpu_class": job.model.gpu_class.name}, max(0.0, gpu_seconds_added)
    )
    rows = list(
        Shard.objects.filter(job=job, round=job.retry_round).values_list(
            "succeeded_records", "error_codes", "started_at"
        )
    )
    outcomes = _round_outcomes(rows)
    for outcome, count in sorted(outcomes.items()):
        increments += counter_increment(families.RECORDS_FINISHED, {**labels, "outcome": outcome}, count)
    increments += counter_increment(families.POISON_RECORDS, labels, outcomes.get(POISON_RECORD, 0))
    if job.finished_at is not None:
        duration = (job.finished_at - job.created_at).total_seconds()
        increments += histogram_increments(families.JOB_DURATION, labels, max(0.0, duration))
    if job.retry_round == 0:
        # Its first round is the round just read: the wait is until the first of its shards started.
        first_start = min((started for *_, started in rows if started is not None), default=None)
        if first_start is not None:
            wait = (first_start - job.created_at).total_seconds()
            increments += histogram_increments(families.JOB_QUEUE_WAIT, labels, max(0.0, wait))
    samples_add(increments)


def _round_outcomes(rows: Iterable[tuple[int, dict[str, int] | None, Any]]) -> Counter[str]:
    """Records of a job's round by outcome, from what the merge recorded on its shards' rows."""
    outcomes: Counter[str] = Counter()
    for succeeded, error_codes, _ in rows:
        outcomes["succeeded"] += succeeded
        outcomes.update({str(code): int(count) for code, count in (error_codes or {}).items()})
    return outcomes


def shards_redispatched_record(*, job: Job, count: int) -> None:
    samples_add(
        counter_increment(families.SHARDS_REDISPATCHED, {"tenant": job.tenant.name, "model": job.model.name}, count)
    )
