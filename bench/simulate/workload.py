"""The simulated fleet's catalog, tenants and jobs.

Four GPU classes (`gpu_model.GPU_CLASSES`), a simulated chat model on each. Tenants have weights
(1, 1, 1, 2, 2, 4 in turn) and a home class each, in turn. At the start every tenant submits a backlog
on its home class a little larger than its weighted share of that class over the run, cut into jobs
whose sizes follow a heavy tail (`job_size`), the largest capped by the backlog; at full size two
tenants' backlogs hold a job of `largest_job` records instead. Meanwhile small jobs (1 to 100
records) arrive at random from random tenants and classes, some through the OpenAI batch path, some
below their tenant's priority; a few running jobs are cancelled, and a few paused and resumed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from django.conf import settings
from django.db import transaction

from bench.simulate.gpu_model import DEFAULT_MAX_TOKENS, GPU_CLASSES, cost_params, record_seconds
from portal.catalog.models import GpuClass, Model
from portal.catalog.services import catalog_publish
from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.openai_api.models import Batch
from portal.openai_api.services.batches import batch_create
from portal.openai_api.services.files import file_upload
from portal.tenancy.models import Quota, Tenant
from portal.tenancy.services import tenant_get_or_create

WEIGHTS = (1.0, 1.0, 1.0, 2.0, 2.0, 4.0)
MEAN_CHARS = 225
CHAT = "/v1/chat/completions"
GIANT_RECORDS_PER_SHARD = 10
"""A job of more records than this a shard, times half the shards a job may have, gets a shard size."""
BACKLOG_MARGIN = 1.3
"""A tenant's backlog over its weighted share of the run: it has work waiting throughout."""


def model_name(gpu_class: str) -> str:
    return f"sim-chat-{gpu_class}"


def catalog_setup(*, spread: float) -> None:
    """The four classes and their simulated models, published to the fleet."""
    for name, tokens_per_s in GPU_CLASSES.items():
        gpu_class, _ = GpuClass.objects.get_or_create(name=name, defaults={"description": "simulated"})
        Model.objects.update_or_create(
            name=model_name(name),
            version="1",
            defaults={
                "engine": Model.Engine.PYTHON,
                "task": Model.Task.CHAT,
                "source": "bench.simulate.gpu_model:factory",
                "gpu_class": gpu_class,
                "load_params": {"tokens_per_s": tokens_per_s, "spread": spread},
                "default_params": {"max_tokens": DEFAULT_MAX_TOKENS, **cost_params(tokens_per_s)},
                "is_default": False,
            },
        )
    catalog_publish()


@dataclass(frozen=True)
class SimTenant:
    pk: int
    name: str
    weight: float
    home: str


TENANT_PREFIX = "sim-"


def tenants_setup(count: int, *, run: str) -> list[SimTenant]:
    """`count` new tenants of the run `run` with their weights, with quotas that let their backlogs in.
    New for each run: a tenant's decayed usage of an earlier run would skew this one's fair share."""
    tenants = []
    classes = list(GPU_CLASSES)
    for n in range(count):
        tenant = tenant_get_or_create(name=f"{TENANT_PREFIX}{run}-{n:03d}")
        tenant.weight = WEIGHTS[n % len(WEIGHTS)]
        tenant.priority = 9
        tenant.save(update_fields=["weight", "priority"])
        Quota.objects.update_or_create(
            tenant=tenant, defaults={"max_concurrent_jobs": None, "max_queued_records": None, "max_stored_bytes": None}
        )
        tenants.append(SimTenant(tenant.pk, tenant.name, tenant.weight, classes[n % len(classes)]))
    return tenants


def job_size(rng: random.Random) -> int:
    """Heavy-tailed: most jobs 1 to 100 records, a quarter up to 10,000, a few up to 200,000."""
    draw = rng.random()
    low, high = (1, 100) if draw < 0.7 else (100, 10_000) if draw < 0.96 else (10_000, 200_000)
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


@dataclass(frozen=True)
class PlannedJob:
    tenant: SimTenant
    gpu_class: str
    records: int
    at_s: float
    openai: bool = False
    priority: int | None = None
    cancel_after_s: float | None = None
    pause_for_s: float | None = None


@dataclass
class WorkloadOptions:
    slots: int
    minutes: float
    tenants: int
    small_jobs_per_s: float
    openai_fraction: float = 0.1
    stop_fraction: float = 0.02
    largest_job: int = 1_000_000
    seed: int = 7


def mean_record_seconds(gpu_class: str) -> float:
    return record_seconds(MEAN_CHARS, DEFAULT_MAX_TOKENS, GPU_CLASSES[gpu_class])


def workload_plan(options: WorkloadOptions, tenants: list[SimTenant]) -> list[PlannedJob]:
    """Every job of the run, in the order of their submission times."""
    rng = random.Random(options.seed)
    seconds = options.minutes * 60
    slots_per_class = options.slots / len(GPU_CLASSES)
    jobs: list[PlannedJob] = []
    weights_by_class: dict[str, float] = {}
    for tenant in tenants:
        weights_by_class[tenant.home] = weights_by_class.get(tenant.home, 0.0) + tenant.weight
    giants = 2 if options.slots >= 500 else 0
    for n, tenant in enumerate(tenants):
        share = tenant.weight / weights_by_class[tenant.home] * slots_per_class * seconds * BACKLOG_MARGIN
        left = max(1, int(share / mean_record_seconds(tenant.home)))
        if n < giants:
            left = max(left, options.largest_job)
            jobs.append(PlannedJob(tenant, tenant.home, options.largest_job, at_s=rng.uniform(0, 5)))
            left -= options.largest_job
        while left > 0:
            size = min(left, job_size(rng))
            jobs.append(PlannedJob(tenant, tenant.home, size, at_s=rng.uniform(0, 10)))
            left -= size
    at = 10.0
    while options.small_jobs_per_s > 0:
        at += rng.expovariate(options.small_jobs_per_s)
        if at >= seconds:
            break
        stop = rng.random() < options.stop_fraction * 2
        jobs.append(
            PlannedJob(
                tenant=rng.choice(tenants),
                gpu_class=rng.choice(list(GPU_CLASSES)),
                records=int(math.exp(rng.uniform(0, math.log(100)))),
                at_s=at,
                openai=rng.random() < options.openai_fraction,
                priority=rng.randrange(0, 9) if rng.random() < 0.2 else None,
            )
        )
        if stop:
            # A larger job, so that it is still running when it is cancelled or paused.
            kind = rng.random() < 0.5
            jobs.append(
                PlannedJob(
                    tenant=rng.choice(tenants),
                    gpu_class=rng.choice(list(GPU_CLASSES)),
                    records=rng.randrange(500, 3000),
                    at_s=at,
                    cancel_after_s=rng.uniform(20, 60) if kind else None,
                    pause_for_s=None if kind else rng.uniform(10, 40),
                )
            )
    return sorted(jobs, key=lambda job: job.at_s)


def _records(rng: random.Random, count: int, tag: str) -> Iterator[dict[str, object]]:
    for n in range(count):
        text = "x" * rng.randint(MEAN_CHARS // 4, MEAN_CHARS * 7 // 4)
        yield {"custom_id": f"{tag}-{n}", "messages": [{"role": "user", "content": text}]}


@dataclass
class Submitted:
    job_id: str
    tenant: SimTenant
    gpu_class: str
    records: int
    input_path: Path
    openai: bool
    batch_id: str = ""
    actions: list[str] = field(default_factory=list)


def submit(planned: PlannedJob, *, data_dir: Path, number: int, rng: random.Random) -> Submitted:
    """Write the job's input and submit it (natively, or as an OpenAI batch's file and batch)."""
    tag = f"j{number}"
    path = data_dir / f"{tag}.jsonl"
    tenant = Tenant.objects.get(pk=planned.tenant.pk)
    name = model_name(planned.gpu_class)
    if planned.openai:
        lines = (
            orjson.dumps(
                {
                    "custom_id": r["custom_id"],
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": name, "messages": r["messages"]},
                },
                option=orjson.OPT_APPEND_NEWLINE,
            )
            for r in _records(rng, planned.records, tag)
        )
        content = b"".join(lines)
        path.write_bytes(content)
        upload = file_upload(tenant=tenant, filename=path.name, purpose="batch", chunks=[content])
        batch = batch_create(tenant=tenant, user=None, input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
        batch = Batch.objects.get(pk=batch.pk)
        job_id = str(batch.job_id) if batch.job_id else ""
        return Submitted(job_id, planned.tenant, planned.gpu_class, planned.records, path, True, batch_id=batch.pk)
    with path.open("wb") as out:
        for record in _records(rng, planned.records, tag):
            out.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
    # A job of millions of records cut by cost would pass the shards a job may have: its owner gives a
    # shard size, as the refusal tells one to.
    most = settings.BATCHERY_MAX_SHARDS_PER_JOB // 2
    shard_size = math.ceil(planned.records / most) if planned.records > most * GIANT_RECORDS_PER_SHARD else None
    with transaction.atomic():
        job: Job = job_submit(
            tenant=tenant,
            request=JobRequest(model_name=name, input_uri=str(path), priority=planned.priority, shard_size=shard_size),
        )
    return Submitted(str(job.id), planned.tenant, planned.gpu_class, planned.records, path, False)
