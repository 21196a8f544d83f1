"""The simulated run's figures, from the slots' event logs, the control plane's logs and the database.

- endings: shard executions the slots acknowledged in the measured window, a second;
- idle gaps: for each slot, from the acknowledgement of one message to the receipt of the next, counted
  only where the slot's class had shards waiting (pending rows) when the gap began;
- fair share: each tenant's slot-seconds on its home class over the whole run, against its weighted share
  among the tenants of that class that had shards waiting at every sample of the measured window;
- exactly once: every job ended, once; every output holds each input id at most once, in input order, a
  finished job's each exactly once (record by record for a sample, line counts for all).
"""

from __future__ import annotations

import bisect
import itertools
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.simulate.workload import Submitted
from portal.jobs.models import FINAL_STATUSES, Job, JobStatus
from tasks.shared.storage import store_for

TICK_LINE = re.compile(r"scheduled \d+ shards on \S+ in ([0-9.]+) ms")


def percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass
class Timeline:
    """Samples taken during the run: time, and what waited then."""

    times: list[float] = field(default_factory=list)
    pending_by_class: list[dict[str, int]] = field(default_factory=list)
    pending_by_tenant: list[dict[tuple[int, str], int]] = field(default_factory=list)

    def to_json(self) -> bytes:
        tenants = [[[tenant, gpu_class, n] for (tenant, gpu_class), n in s.items()] for s in self.pending_by_tenant]
        data = {"times": self.times, "pending_by_class": self.pending_by_class, "pending_by_tenant": tenants}
        return orjson.dumps(data)

    def class_waiting(self, gpu_class: str, at: float) -> bool:
        index = bisect.bisect_right(self.times, at) - 1
        return index >= 0 and self.pending_by_class[index].get(gpu_class, 0) > 0


def read_events(paths: Iterable[Path]) -> list[dict[str, Any]]:
    events = []
    for path in paths:
        if path.exists():
            events += [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return events


def executions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if "task" in event]


def endings_per_s(events: list[dict[str, Any]], start: float, end: float) -> float:
    done = sum(len(e["shards"]) for e in executions(events) if e["outcome"] == "acked" and start <= e["ended"] < end)
    return done / max(end - start, 1e-9)


def shard_lengths(events: list[dict[str, Any]], start: float, end: float) -> list[float]:
    """Each acknowledged message's time on its slot, a shard, for those that ended in the window: the
    `S` of the README's capacity model (a job's first shards are short by design, its last ones too)."""
    return [
        (e["ended"] - e["received"]) / len(e["shards"])
        for e in executions(events)
        if e["outcome"] == "acked" and start <= e["ended"] < end
    ]


def idle_gaps(events: list[dict[str, Any]], timeline: Timeline, start: float, end: float) -> list[float]:
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in executions(events):
        by_worker[event["worker"]].append(event)
    away: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for fault in events:
        if fault.get("fault") in ("drain", "vanish", "broker_loss"):
            for worker in fault["workers"]:
                away[worker].append((fault["at"], fault["until"]))
    gaps = []
    for worker, runs in by_worker.items():
        runs.sort(key=lambda e: e["received"])
        for before, after in itertools.pairwise(runs):
            if before["outcome"] != "acked" or not start <= before["ended"] < end:
                continue
            # A slot drained or cut off by a fault idles by design, not for want of the control plane.
            if any(before["ended"] < until and after["received"] > at for at, until in away[worker]):
                continue
            if timeline.class_waiting(before["gpu_class"], before["ended"]):
                gaps.append(after["received"] - before["ended"])
    return gaps


def fair_share_deviation(
    events: list[dict[str, Any]],
    timeline: Timeline,
    jobs: dict[str, Submitted],
    start: float,
    end: float,
    *,
    waiting_from: float,
) -> tuple[float, int]:
    """The largest |received share / weighted share - 1| over the slot-seconds from `start` to `end`, of
    the tenants with shards waiting at every sample from `waiting_from` (after their backlogs were
    submitted and planned) to `end`; and how many tenants that is."""
    seconds: Counter[tuple[int, str]] = Counter()
    for event in executions(events):
        span = min(event["ended"], end) - max(event["received"], start)
        if span <= 0:
            continue
        for job_id, _ in event["shards"]:
            job = jobs.get(job_id)
            if job is not None:
                seconds[(job.tenant.pk, event["gpu_class"])] += span / len(event["shards"])
    samples = [
        pending
        for at, pending in zip(timeline.times, timeline.pending_by_tenant, strict=True)
        if waiting_from <= at < end
    ]
    tenants = {job.tenant.pk: job.tenant for job in jobs.values()}
    deviation, counted = 0.0, 0
    classes = {tenant.home for tenant in tenants.values()}
    for gpu_class in classes:
        waiting = [
            tenant
            for tenant in tenants.values()
            if tenant.home == gpu_class and samples and all(s.get((tenant.pk, gpu_class), 0) > 0 for s in samples)
        ]
        total_seconds = sum(seconds[(t.pk, gpu_class)] for t in waiting)
        total_weight = sum(t.weight for t in waiting)
        if len(waiting) < 2 or total_seconds <= 0:
            continue
        for tenant in waiting:
            share = seconds[(tenant.pk, gpu_class)] / total_seconds
            deviation = max(deviation, abs(share / (tenant.weight / total_weight) - 1))
            counted += 1
    return deviation, counted


def scheduler_ticks(log_paths: Iterable[Path]) -> list[float]:
    ticks = []
    for path in log_paths:
        if path.exists():
            ticks += [float(m.group(1)) for m in TICK_LINE.finditer(path.read_text(errors="replace"))]
    return ticks


def _lines(uri: str) -> list[dict[str, Any]]:
    if not uri:
        return []
    store = store_for(uri)
    if not store.exists(uri):
        return []
    with store.open_read(uri) as stream:
        return [orjson.loads(line) for line in stream if line.strip()]


@dataclass
class Exactness:
    jobs: int = 0
    ended: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    duplicated: int = 0
    checked_by_record: int = 0
    problems: list[str] = field(default_factory=list)


def check_exactly_once(jobs: Sequence[Submitted], *, sample: int) -> Exactness:
    """Every job ended once; outputs hold each input id at most once and in order, a succeeded job's each
    exactly once (all of them counted, `sample` of them read record by record against the input)."""
    result = Exactness(jobs=len(jobs))
    sampled = 0
    for submitted in jobs:
        if not submitted.job_id:
            continue
        job = Job.objects.get(pk=submitted.job_id)
        result.by_status[job.status] += 1
        if job.status not in FINAL_STATUSES:
            result.lost += submitted.records
            result.problems.append(f"job {job.id} did not end ({job.status})")
            continue
        result.ended += 1
        endings = [status for status in job.events.values_list("status", flat=True) if status in FINAL_STATUSES]
        if len(endings) != 1:
            result.duplicated += 1
            result.problems.append(f"job {job.id} ended {len(endings)} times: {endings}")
        output = _lines(job.output_uri)
        ids = [line["custom_id"] for line in output]
        extra = len(ids) - len(set(ids))
        result.duplicated += extra
        if job.status == JobStatus.SUCCEEDED:
            if len(ids) != submitted.records:
                result.lost += max(0, submitted.records - len(set(ids)))
                result.problems.append(f"job {job.id}: {len(ids)} output lines for {submitted.records} records")
            if sampled < sample:
                sampled += 1
                expected = [orjson.loads(line)["custom_id"] for line in submitted.input_path.read_bytes().splitlines()]
                if ids != expected:
                    result.problems.append(f"job {job.id}: output ids differ from the input's")
                    result.lost += len(set(expected) - set(ids))
        elif extra:
            result.problems.append(f"job {job.id} ({job.status}): {extra} duplicated lines")
    result.checked_by_record = sampled
    return result


def tick_summary(ticks: Sequence[float]) -> tuple[float, float]:
    return (statistics.median(ticks) if ticks else 0.0, percentile(ticks, 0.99))
