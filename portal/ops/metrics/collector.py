"""The portal's /metrics, read at scrape time: stored counters and histograms, and live gauges.

Every figure comes from PostgreSQL or Redis, so any portal process gives the same answer. The
queries are grouped counts over indexed columns and one pipelined round trip to the broker; their
cost grows with tenants, queues and slots, not with jobs ever run.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import redis
from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from portal.catalog.models import GpuClass, Model
from portal.jobs.models import FINAL_STATUSES, Job
from portal.jobs.quota import quota_usage
from portal.ops.metrics.families import STORED, Family
from portal.ops.metrics.sweeps import reconcile_last_sweep
from portal.ops.models import MetricSample
from portal.ops.selectors import fleet_overview
from portal.tenancy.models import Quota
from tasks.shared.broker_probe import queue_depths
from tasks.shared.config import declared_queues, gpu_queue, queue_gpu_class
from tasks.shared.fleet import LAST_SEEN_KEY
from tasks.shared.redis_client import redis_client

# A slot that vanished without stopping cleanly stays visible this long (its heartbeat alert fires).
LAST_SEEN_RETENTION_S = 24 * 3600


class ControlCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        slots = fleet_overview()
        yield from stored_families()
        yield from job_gauges()
        yield from quota_gauges()
        yield from queue_gauges(slots)
        yield from fleet_gauges(slots)
        yield from reconcile_gauges()


def _label_values(family: Family, labels: dict[str, str]) -> list[str]:
    return [str(labels.get(name, "")) for name in family.labels]


def stored_families() -> Iterator[Metric]:
    rows: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for name, key, amount in MetricSample.objects.values_list("name", "labels", "value"):
        rows[name].append((json.loads(key), amount))
    for family in STORED:
        if family.kind == "counter":
            counter = CounterMetricFamily(family.name, family.help, labels=family.labels)
            for labels, value in rows[family.sample()]:
                counter.add_metric(_label_values(family, labels), value)
            yield counter
        else:
            yield _histogram(family, rows)


def _histogram(family: Family, rows: dict[str, list[tuple[dict[str, str], float]]]) -> Metric:
    histogram = HistogramMetricFamily(family.name, family.help, labels=family.labels)
    buckets: dict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
    for labels, value in rows[family.sample("_bucket")]:
        buckets[tuple(_label_values(family, labels))][labels["le"]] = value
    sums = {tuple(_label_values(family, labels)): value for labels, value in rows[family.sample("_sum")]}
    bounds = [*(repr(float(bound)) for bound in family.buckets), "+Inf"]
    for key, counts in buckets.items():
        # A bucket below every observation was never written: it holds 0.
        cumulative = [(bound, counts.get(bound, 0.0)) for bound in bounds]
        histogram.add_metric(list(key), cumulative, sum_value=sums.get(key, 0.0))
    return histogram


def job_gauges() -> Iterator[Metric]:
    jobs = GaugeMetricFamily("batchery_jobs", "Jobs not yet ended, by status.", labels=("tenant", "status"))
    active = Job.objects.exclude(status__in=FINAL_STATUSES).values("tenant__name", "status").annotate(n=Count("id"))
    for row in active:
        jobs.add_metric([row["tenant__name"], row["status"]], row["n"])
    yield jobs


def quota_gauges() -> Iterator[Metric]:
    limit = GaugeMetricFamily("batchery_quota_limit", "A tenant's quota limit.", labels=("tenant", "quota"))
    used = GaugeMetricFamily(
        "batchery_quota_used", "What the tenant uses of the quota now.", labels=("tenant", "quota")
    )
    quotas = list(Quota.objects.select_related("tenant"))
    usage = quota_usage(tenant_ids=[quota.tenant_id for quota in quotas])
    for quota in quotas:
        use = usage[quota.tenant_id]
        figures = {
            "max_concurrent_jobs": (quota.max_concurrent_jobs, use.concurrent_jobs),
            "max_queued_records": (quota.max_queued_records, use.queued_records),
            "gpu_seconds_per_month": (quota.gpu_seconds_per_month, use.gpu_seconds_this_month),
        }
        for name, (bound, in_use) in figures.items():
            used.add_metric([quota.tenant.name, name], float(in_use))
            if bound is not None:
                limit.add_metric([quota.tenant.name, name], float(bound))
    yield limit
    yield used


def _known_queues(slots: list[dict[str, Any]]) -> set[str]:
    models = Model.objects.filter(enabled=True).select_related("gpu_class")
    return {
        *declared_queues(),
        *(gpu_queue(model.gpu_class.name, model.gpus_per_replica) for model in models),
        *(slot["queue"] for slot in slots if slot.get("queue")),
    }


def queue_gauges(slots: list[dict[str, Any]]) -> Iterator[Metric]:
    """Each known queue's backlog: those the site declares, its models use, and its live slots consume."""
    labels = ("queue_name", "gpu_class")
    ready = GaugeMetricFamily(
        "batchery_queue_ready_messages", "Messages waiting in the queue, over all priority lists.", labels=labels
    )
    reserved = GaugeMetricFamily(
        "batchery_queue_reserved_messages", "Messages delivered to a worker, not yet acknowledged.", labels=labels
    )
    depths = queue_depths(_known_queues(slots)) or {}
    for queue, depth in sorted(depths.items()):
        ready.add_metric([queue, queue_gpu_class(queue)], depth.ready)
        reserved.add_metric([queue, queue_gpu_class(queue)], depth.reserved)
    yield ready
    yield reserved


def fleet_gauges(slots: list[dict[str, Any]]) -> Iterator[Metric]:
    classes = {gpu_class for gpu_class in GpuClass.objects.values_list("name", flat=True)}
    classes |= {slot.get("gpu_class", "") for slot in slots}
    alive = Counter(slot.get("gpu_class", "") for slot in slots)
    busy = Counter(slot.get("gpu_class", "") for slot in slots if slot.get("current_shard"))
    draining = Counter(slot.get("gpu_class", "") for slot in slots if slot.get("draining"))
    for name, text, counts in (
        ("batchery_slots_alive", "Slots whose heartbeat is live.", alive),
        ("batchery_slots_busy", "Live slots running a shard now.", busy),
        ("batchery_slots_draining", "Live slots drained by an operator.", draining),
    ):
        family = GaugeMetricFamily(name, text, labels=("gpu_class",))
        for gpu_class in sorted(classes):
            family.add_metric([gpu_class], counts.get(gpu_class, 0))
        yield family
    yield _last_heartbeats()


def _last_heartbeats() -> Metric:
    family = GaugeMetricFamily(
        "batchery_slot_last_heartbeat_timestamp_seconds",
        "Unix time of each slot's last heartbeat.",
        labels=("host", "slot", "gpu_class"),
    )
    client = redis_client()
    try:
        entries = client.hgetall(LAST_SEEN_KEY)
    except redis.RedisError:
        return family
    forgotten = []
    now = time.time()
    for key, raw in entries.items():
        try:
            beat = json.loads(raw)
            labels, at = [str(beat["host"]), str(beat["slot"]), str(beat["gpu_class"])], float(beat["at"])
        except (ValueError, KeyError, TypeError):
            # One unreadable entry must not take the whole scrape down; it is dropped like a stale one.
            forgotten.append(key)
            continue
        if now - at > LAST_SEEN_RETENTION_S:
            forgotten.append(key)
            continue
        family.add_metric(labels, at)
    if forgotten:
        with contextlib.suppress(redis.RedisError):
            client.hdel(LAST_SEEN_KEY, *forgotten)
    return family


def reconcile_gauges() -> Iterator[Metric]:
    last = GaugeMetricFamily(
        "batchery_reconcile_last_success_timestamp_seconds", "Unix time the reconciler last finished a sweep."
    )
    duration = GaugeMetricFamily("batchery_reconcile_last_duration_seconds", "How long that sweep took.")
    sweep = reconcile_last_sweep()
    if sweep is not None:
        last.add_metric([], sweep.finished_at)
        duration.add_metric([], sweep.duration_s)
    yield last
    yield duration
