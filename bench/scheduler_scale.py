"""A scheduler tick at fleet size (`manage.py bench --scheduler-jobs N`): one queue with its live slots, many
tenants and many running jobs, each with shards waiting.

The rows are made with `bulk_create` (the tick reads nothing else from storage); the queue's slots beat
through the slots' own code, so the tick sizes its window from them. Two kinds of tick are timed, each
`ticks` times: one whose window is full (the tick after a shard was sent, most ticks of a busy fleet) and
one with a place free (a shard just ended: the tick chooses the next in fair-share order and sends it).
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from bench.catalog import bench_class_model
from bench.simulate.report import percentile
from portal.catalog.models import Model
from portal.execution.capacity import live_slots
from portal.execution.scheduler import schedule_queue
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.config import gpu_queue
from tasks.shared.fleet import heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot.heartbeat import heartbeat_clear_commands, heartbeat_commands

GPU_CLASS = "bench-scheduler"
SHARD_SECONDS = 20.0
RECORDS_PER_SHARD = 25


@dataclass(frozen=True)
class TickFigures:
    tenants: int
    jobs: int
    waiting_shards: int
    slots: int
    full_ms: list[float]
    one_free_ms: list[float]
    sent_when_full: int
    sent_when_free: int

    def summary(self, values: list[float]) -> str:
        return f"p50 {statistics.median(values):.1f} ms, p99 {percentile(values, 0.99):.1f} ms"


def _model() -> Model:
    return bench_class_model(name="bench-scheduler", gpu_class=GPU_CLASS)


def _beats(slots: int, queue: str) -> list[str]:
    keys = [heartbeat_key("bench-sched", str(n), gpu_class=GPU_CLASS, devices=str(n)) for n in range(slots)]
    pipe = redis_client().pipeline(transaction=False)
    for n, key in enumerate(keys):
        beat = {"host": "bench-sched", "slot": str(n), "gpu_class": GPU_CLASS, "gpus": [n], "pid": 0}
        beat |= {"worker": f"bench{n}@sched", "queue": queue, "loaded_models": [], "current_shard": None}
        heartbeat_commands(pipe, key, {**beat, "telemetry": {}, "at": time.time()})
    pipe.execute()
    return keys


def _rows(*, tenants: int, jobs: int, waiting_per_job: int, in_flight: int) -> None:
    model = _model()
    owners = []
    for n in range(tenants):
        tenant = tenant_get_or_create(name=f"bench-sched-{n:03d}")
        tenant.weight = (1.0, 2.0, 4.0)[n % 3]
        tenant.save(update_fields=["weight"])
        owners.append(tenant)
    created = Job.objects.bulk_create(
        Job(
            tenant=owners[n % tenants],
            model=model,
            status=JobStatus.RUNNING,
            input_uri="file:///bench/in.jsonl",
            output_uri=f"file:///bench/{n}/output.jsonl",
            total_records=(waiting_per_job + 1) * RECORDS_PER_SHARD,
            started_at=timezone.now(),
        )
        for n in range(jobs)
    )
    shards = []
    for number, job in enumerate(created):
        for index in range(waiting_per_job + 1):
            sent = index == 0 and number < in_flight
            shards.append(
                Shard(
                    job=job,
                    index=index,
                    first_record=index * RECORDS_PER_SHARD,
                    record_count=RECORDS_PER_SHARD,
                    estimated_seconds=SHARD_SECONDS,
                    input_uri=f"file:///bench/{job.pk}/{index}.jsonl",
                    prefix_uri=f"file:///bench/{job.pk}/shards/{index}",
                    status=ShardStatus.DISPATCHED if sent else ShardStatus.PENDING,
                    task_id=f"shard-{job.pk}-{index}-{uuid.uuid4().hex[:12]}" if sent else "",
                    attempt=1 if sent else 0,
                    dispatched_at=timezone.now() if sent else None,
                )
            )
            if len(shards) >= 20_000:
                Shard.objects.bulk_create(shards)
                shards = []
    Shard.objects.bulk_create(shards)


def _timed(queue: str) -> tuple[float, int]:
    """The tick's milliseconds and the shards it sent."""
    started = time.perf_counter()
    sent = schedule_queue(queue)
    return (time.perf_counter() - started) * 1000, sent


def run_scheduler_bench(*, tenants: int, jobs: int, waiting_per_job: int, slots: int, ticks: int) -> TickFigures:
    queue = gpu_queue(GPU_CLASS)
    in_flight = min(jobs, 2 * slots)
    _rows(tenants=tenants, jobs=jobs, waiting_per_job=waiting_per_job, in_flight=in_flight)
    keys = _beats(slots, queue)
    try:
        time.sleep(2.5)  # past the capacity reader's cache of the slots
        assert live_slots(queue) == slots, "the bench's slots are read from their heartbeats"
        full = [_timed(queue) for _ in range(ticks)]
        one_free: list[tuple[float, int]] = []
        for _ in range(ticks):
            with transaction.atomic():
                ended = Shard.objects.filter(job__model__gpu_class__name=GPU_CLASS, status=ShardStatus.DISPATCHED)
                Shard.objects.filter(pk=ended.values_list("pk", flat=True)[:1]).update(status=ShardStatus.SUCCEEDED)
            one_free.append(_timed(queue))
        return TickFigures(
            tenants=tenants,
            jobs=jobs,
            waiting_shards=jobs * waiting_per_job,
            slots=slots,
            full_ms=[ms for ms, _ in full],
            one_free_ms=[ms for ms, _ in one_free],
            sent_when_full=sum(sent for _, sent in full),
            sent_when_free=sum(sent for _, sent in one_free),
        )
    finally:
        client = redis_client()
        pipe = client.pipeline(transaction=False)
        for key in keys:
            heartbeat_clear_commands(pipe, key)
        for key in client.scan_iter(match=f"{queue}*"):  # the messages sent, one list a priority
            pipe.delete(key)
        pipe.execute()
        Shard.objects.filter(job__model__gpu_class__name=GPU_CLASS).delete()
        Job.objects.filter(model__gpu_class__name=GPU_CLASS).delete()


def render_scheduler(figures: TickFigures) -> str:
    command = (
        "python manage.py bench --skip-io --sentences 0 --metrics-sentences 0 --fairness-slots 0 --ceiling-slots 0 "
        "--api-jobs 0 --reconcile-jobs 0 --retention-shards 0 --fleet-slots 0 "
        f"--scheduler-jobs {figures.jobs} --scheduler-tenants {figures.tenants} --scheduler-slots {figures.slots} "
        f"--scheduler-waiting {figures.waiting_shards // max(figures.jobs, 1)}"
    )
    return "\n".join(
        [
            f"scheduler tick at {figures.slots} slots, {figures.tenants} tenants, {figures.jobs:,} running jobs, "
            f"{figures.waiting_shards:,} shards waiting:",
            f"  window full (nothing to send)   {figures.summary(figures.full_ms)}",
            f"  one place free (one shard sent) {figures.summary(figures.one_free_ms)}",
            f"rerun: {command}",
        ]
    )
