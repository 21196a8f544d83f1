"""The usage ledger: one line per job, written (and priced, `portal.jobs.billing`) in the transaction that ends it.

GPU-seconds are what the job's shards held a replica for (model load plus compute, from the
manifests the workers committed) times the GPUs a replica of the model takes.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db.models import Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.catalog.models import Adapter
from portal.jobs.billing import line_cost
from portal.jobs.models import Job, JobAdapterUsage, JobUsage

REWRITTEN = [field.name for field in JobUsage._meta.concrete_fields if not field.primary_key]
"""Every field of a ledger line but its job: a retried job's line is rewritten whole."""


def month_of(moment: dt.datetime) -> dt.date:
    return moment.date().replace(day=1)


def usage_record(*, job: Job) -> float:
    """Write (or rewrite, after a retry) the ledger line of a job that has just ended, read with its
    model, GPU class and tenant; return the GPU-seconds it adds (a retry adds only its own)."""
    charged = JobUsage.objects.filter(job=job).values_list("gpu_seconds", flat=True).first() or 0.0
    sums = job.shards.aggregate(
        prompt=Coalesce(Sum("prompt_tokens"), 0),
        completion=Coalesce(Sum("completion_tokens"), 0),
        cached=Coalesce(Sum("cached_prompt_tokens"), 0),
        compute=Coalesce(Sum("compute_seconds"), 0.0),
        load=Coalesce(Sum("load_seconds"), 0.0),
    )
    ended = job.finished_at or timezone.now()
    usage = JobUsage(
        job=job,
        tenant_id=job.tenant_id,
        model_id=job.model_id,
        period=month_of(ended),
        status=job.status,
        records_succeeded=job.succeeded_records,
        records_failed=job.failed_records,
        prompt_tokens=sums["prompt"],
        completion_tokens=sums["completion"],
        cached_prompt_tokens=sums["cached"],
        gpu_seconds=(sums["compute"] + sums["load"]) * job.model.gpus_per_replica,
        recorded_at=ended,
    )
    totals = _adapter_totals(job) if job.adapters else {}
    # Priced now, at the prices in force the day it ended, and kept: the bill never re-prices it.
    usage.cost = line_cost(usage, splits=[split for _, split in totals.values()], gpu_class_id=job.model.gpu_class_id)
    # One upsert: the ending's transaction holds the job's row, so nobody else writes this line meanwhile.
    JobUsage.objects.bulk_create([usage], update_conflicts=True, unique_fields=["job"], update_fields=REWRITTEN)
    if job.adapters:
        _record_adapter_usage(usage, totals)
    return usage.gpu_seconds - charged


def _adapter_totals(job: Job) -> dict[str, tuple[list[int], dict[str, Any]]]:
    """The job's usage by adapter key (`name@version`; the base model under its own), summed over the shards'
    manifests: each key's counts (succeeded, failed, prompt, completion) and its split as `line_cost` reads it."""
    ids = {f"{entry['spec']['name']}@{entry['spec']['version']}": entry["id"] for entry in job.adapters.values()}
    # An adapter deleted since keeps its ledger lines by name.
    existing = set(Adapter.objects.filter(pk__in=ids.values()).values_list("pk", flat=True))
    totals: dict[str, list[int]] = {}
    for split in job.shards.exclude(adapter_usage={}).values_list("adapter_usage", flat=True):
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
    """The ledger line's split by adapter (`_adapter_totals`)."""
    JobAdapterUsage.objects.filter(usage=usage).delete()
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
