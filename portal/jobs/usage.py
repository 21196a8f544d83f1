"""The usage ledger: one line per ending of a job (its first, round 0, and each retry round's), written (and
priced, `portal.jobs.billing`) in the transaction that ends it, and never rewritten.

A line holds its round's usage only, in the month that round ended in: a retry in a later month adds a line
to that month and leaves the earlier month's bill as it was. GPU-seconds are what the round's shards held a
replica for (model load plus compute, from the manifests the workers committed) times the GPUs a replica of
the model takes.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db.models import QuerySet, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.catalog.models import Adapter
from portal.jobs.billing import line_cost
from portal.jobs.models import Job, JobAdapterUsage, JobUsage, Shard


def month_of(moment: dt.datetime) -> dt.date:
    return moment.date().replace(day=1)


def usage_record(*, job: Job) -> float:
    """Write the ledger line of the round of a job that has just ended, read with its model, GPU class and
    tenant; return the GPU-seconds it adds (the round's own; nothing where that ending has its line already)."""
    round_ = job.retry_round
    # The ending's transaction holds the job's row, so this read is the truth: a redelivered ending stops here.
    if JobUsage.objects.filter(job=job, round=round_).exists():
        return 0.0
    shards = job.shards.filter(round=round_)
    sums = shards.aggregate(
        prompt=Coalesce(Sum("prompt_tokens"), 0),
        completion=Coalesce(Sum("completion_tokens"), 0),
        cached=Coalesce(Sum("cached_prompt_tokens"), 0),
        compute=Coalesce(Sum("compute_seconds"), 0.0),
        load=Coalesce(Sum("load_seconds"), 0.0),
    )
    succeeded, failed = _round_records(job)
    ended = job.finished_at or timezone.now()
    usage = JobUsage(
        job=job,
        round=round_,
        tenant_id=job.tenant_id,
        model_id=job.model_id,
        period=month_of(ended),
        status=job.status,
        records_succeeded=succeeded,
        records_failed=failed,
        prompt_tokens=sums["prompt"],
        completion_tokens=sums["completion"],
        cached_prompt_tokens=sums["cached"],
        gpu_seconds=(sums["compute"] + sums["load"]) * job.model.gpus_per_replica,
        recorded_at=ended,
    )
    totals = _adapter_totals(job, shards) if job.adapters else {}
    # Priced now, at the prices in force the day it ended, and kept: the bill never re-prices it.
    usage.cost = line_cost(usage, splits=[split for _, split in totals.values()], gpu_class_id=job.model.gpu_class_id)
    # Insert-if-absent: the unique (job, round) keeps one line per ending even past the read above.
    JobUsage.objects.bulk_create([usage], ignore_conflicts=True)
    if job.adapters:
        _record_adapter_usage(usage, totals)
    return usage.gpu_seconds


def _round_records(job: Job) -> tuple[int, int]:
    """The records the ending round ran, succeeded and failed. The job's counts are its totals over all its
    rounds: a retry ran the records still failed before it, so its successes are the job's successes less
    those of its earlier lines, and its failures are the job's (the records that fail still)."""
    if not job.retry_round:
        return job.succeeded_records, job.failed_records
    before = JobUsage.objects.filter(job=job, round__lt=job.retry_round).aggregate(
        succeeded=Coalesce(Sum("records_succeeded"), 0)
    )["succeeded"]
    return max(job.succeeded_records - before, 0), job.failed_records


def _adapter_totals(job: Job, shards: QuerySet[Shard]) -> dict[str, tuple[list[int], dict[str, Any]]]:
    """The round's usage by adapter key (`name@version`; the base model under its own), summed over its shards'
    manifests: each key's counts (succeeded, failed, prompt, completion) and its split as `line_cost` reads it."""
    ids = {f"{entry['spec']['name']}@{entry['spec']['version']}": entry["id"] for entry in job.adapters.values()}
    # An adapter deleted since keeps its ledger lines by name.
    existing = set(Adapter.objects.filter(pk__in=ids.values()).values_list("pk", flat=True))
    totals: dict[str, list[int]] = {}
    for split in shards.exclude(adapter_usage={}).values_list("adapter_usage", flat=True):
        for key, counts in split.items():
            summed = totals.setdefault(key, [0, 0, 0, 0])
            for position, count in enumerate(counts):
                summed[position] += count
    return {
        key or job.model.name: (
            counts,
            {
                "adapter_id": ids.get(key) if ids.get(key) in existing else None,
                "records": counts[0] + counts[1],
                "prompt_tokens": counts[2],
                "completion_tokens": counts[3],
            },
        )
        for key, counts in sorted(totals.items())
    }


def _record_adapter_usage(usage: JobUsage, totals: dict[str, tuple[list[int], dict[str, Any]]]) -> None:
    """The ledger line's split by adapter (`_adapter_totals`), written with the line."""
    # `bulk_create` sets no id where it may skip a conflict.
    usage.pk = JobUsage.objects.values_list("pk", flat=True).get(job_id=usage.job_id, round=usage.round)
    JobAdapterUsage.objects.bulk_create(
        JobAdapterUsage(
            usage=usage,
            adapter_id=split["adapter_id"],
            name=name,
            records_succeeded=counts[0],
            records_failed=counts[1],
            prompt_tokens=counts[2],
            completion_tokens=counts[3],
        )
        for name, (counts, split) in totals.items()
    )
