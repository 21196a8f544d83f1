"""The fairness benchmark: the scheduler on a simulated fleet (CPU slots, a model that sleeps a
millisecond a record in place of a GPU, see `bench.engines`).

One table: how long tenant B's 100-record job waits behind tenant A's 100,000-record one and when
it ends; the GPU-seconds split of tenants weighted 3 and 1 over a busy stretch; the slots' busy
fraction meanwhile (from the shards' own start and end times); and the scheduler's cost per shard:
a 1,000-shard job of a no-op model as scheduled (a window of two shards a slot, more for short
shards, sent in waves) against the same job with every shard sent at once in one chord, as before
the scheduler (a window without bound, so a wave as large as the job), both on the same stack size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
from django.conf import settings

from bench.catalog import bench_model_register
from portal.catalog.models import Model
from portal.devstack.stack import Stack, StackOptions
from portal.jobs.models import FINAL_STATUSES, Job, Shard
from portal.jobs.requests import JobRequest
from portal.jobs.services.stop import job_cancel
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Tenant
from portal.tenancy.services import tenant_get_or_create

MODEL_NAME = "bench-sleep"
SECONDS_PER_RECORD = 0.001
HALF_LIFE_S = 20


@dataclass(frozen=True)
class FairnessFigures:
    slots: int
    b_wait_s: float
    b_end_s: float
    heavy_light_ratio: float
    busy_fraction_min: float
    scheduled_s: float
    all_at_once_s: float
    shards: int

    @property
    def overhead_ms_per_shard(self) -> float:
        return (self.scheduled_s - self.all_at_once_s) / self.shards * 1000


def busy_seconds(shards: Iterable[Shard], start: float, end: float) -> float:
    """Seconds of [start, end] that the shards' committed attempts ran."""
    return sum(
        max(0.0, min(s.finished_at.timestamp(), end) - max(s.started_at.timestamp(), start))
        for s in shards
        if s.started_at and s.finished_at
    )


def slot_busy_fractions(shards: Iterable[Shard], start: float, end: float) -> dict[str, float]:
    """Each slot's (Celery worker's) busy fraction of [start, end]."""
    busy: dict[str, float] = {}
    for shard in shards:
        busy[shard.worker] = busy.get(shard.worker, 0.0) + busy_seconds([shard], start, end)
    return {worker: seconds / (end - start) for worker, seconds in busy.items()}


def _records(path: Path, count: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for n in range(count):
            out.write(orjson.dumps({"custom_id": f"r{n:07d}", "input": f"record {n:07d}"}) + b"\n")
    return path


def _wait_end(job: Job, timeout_s: float = 600) -> Job:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.status in FINAL_STATUSES:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job.id} still {job.status} after {timeout_s:.0f}s")


def _wait_running(job: Job) -> None:
    while (job := Job.objects.get(pk=job.pk)).status in ("queued", "planning"):
        time.sleep(0.1)


@contextmanager
def _stack(slots: int, **scheduler: str) -> Iterator[None]:
    env = {
        **os.environ,
        "BATCHERY_TARGET_SHARD_SECONDS": "1",
        "BATCHERY_FAIR_SHARE_HALF_LIFE_S": str(HALF_LIFE_S),
        **{f"BATCHERY_SCHEDULER_{name.upper()}": value for name, value in scheduler.items()},
    }
    stack = Stack(StackOptions(portal=False, flower=False, cpu_slots=slots, logs_to_files=True), env=env)
    stack.start()
    try:
        stack.wait_for_workers(queues={"control", "planning", "gpu.cpu"})
        time.sleep(6)  # the slots' first heartbeats, from which the scheduler sizes the window
        yield
    finally:
        stack.stop()


def _submit(
    tenant: Tenant, path: Path, *, shard_size: int | None = None, params: dict[str, float] | None = None
) -> Job:
    return job_submit(
        tenant=tenant,
        request=JobRequest(model_name=MODEL_NAME, input_uri=str(path), shard_size=shard_size, params=params),
    )


def run_fairness_bench(*, slots: int, say: Callable[[str], None]) -> FairnessFigures:
    data = Path(settings.VAR_DIR) / "bench" / "fairness"
    bench_model_register(
        name=MODEL_NAME,
        task=Model.Task.CLASSIFY,
        factory="sleep_factory",
        default_params={"sleep_per_record": SECONDS_PER_RECORD, "seconds_per_record": SECONDS_PER_RECORD},
    )
    a, b = tenant_get_or_create(name="bench-a"), tenant_get_or_create(name="bench-b")
    heavy, light = tenant_get_or_create(name="bench-heavy"), tenant_get_or_create(name="bench-light")
    Tenant.objects.filter(pk=heavy.pk).update(weight=3)
    Tenant.objects.filter(pk=light.pk).update(weight=1)
    noop = _records(data / "noop-1000.jsonl", 1000)
    with _stack(slots, shards_per_slot="2"):
        say(f"fairness: A submits 100,000 records, B 100 records 10 s later ({slots} slots, 1 ms a record) ...")
        big = _submit(a, _records(data / "a-100000.jsonl", 100_000))
        time.sleep(10)
        small = _wait_end(_submit(b, _records(data / "b-100.jsonl", 100)))
        first_start = min(s.started_at.timestamp() for s in small.shards.all() if s.started_at)
        b_wait = first_start - small.created_at.timestamp()
        b_end = small.finished_at.timestamp() - small.created_at.timestamp() if small.finished_at else float("nan")
        _wait_end(big)

        say("fairness: tenants weighted 3 and 1, both with more work than the fleet, for 40 s ...")
        # Enough work that neither tenant runs out before the measured stretch ends.
        jobs = [_submit(t, _records(data / f"{t.name}.jsonl", 60_000 * slots)) for t in (heavy, light)]
        for job in jobs:
            _wait_running(job)
        start = time.time() + 5
        time.sleep(45)
        end = time.time() - 3
        time.sleep(3)
        shards = {job.pk: list(Shard.objects.filter(job=job, finished_at__isnull=False)) for job in jobs}
        ratio = busy_seconds(shards[jobs[0].pk], start, end) / max(busy_seconds(shards[jobs[1].pk], start, end), 1e-9)
        fractions = slot_busy_fractions([s for group in shards.values() for s in group], start, end)
        for job in jobs:
            job.refresh_from_db()
            if job.status not in FINAL_STATUSES:
                _wait_end(job_cancel(job=job))

        say("overhead: 1,000 shards of a no-op model, scheduled ...")
        scheduled = _timed_noop(a, noop)
    # A second of work ahead has no bound for no-op shards: every slot gets a million places, the
    # window holds the whole job, and its waves (half a slot's places) too.
    with _stack(slots, max_shards_per_slot="1000000", seconds_ahead="1000000"):
        say("overhead: the same job with every shard sent at once ...")
        all_at_once = _timed_noop(a, noop)
    return FairnessFigures(
        slots=slots,
        b_wait_s=b_wait,
        b_end_s=b_end,
        heavy_light_ratio=ratio,
        busy_fraction_min=min(fractions.values()) if fractions else 0.0,
        scheduled_s=scheduled,
        all_at_once_s=all_at_once,
        shards=1000,
    )


def _timed_noop(tenant: Tenant, path: Path) -> float:
    started = time.perf_counter()
    job = _wait_end(_submit(tenant, path, shard_size=1, params={"sleep_per_record": 0}))
    if job.status != "succeeded":
        raise RuntimeError(f"the no-op job ended {job.status}: {job.error}")
    return time.perf_counter() - started


def render_fairness(figures: FairnessFigures) -> str:
    rows = [
        ("B's first shard started after its submission", f"{figures.b_wait_s:.2f} s", "<= 5 s"),
        ("B ended after its submission", f"{figures.b_end_s:.2f} s", "<= 15 s"),
        ("GPU-seconds heavy : light (weights 3 : 1)", f"{figures.heavy_light_ratio:.2f}", "3 +- 10 %"),
        ("slot busy fraction, lowest slot", f"{figures.busy_fraction_min:.3f}", ">= 0.95"),
        ("1,000 no-op shards, scheduled", f"{figures.scheduled_s:.1f} s", ""),
        ("1,000 no-op shards, all sent at once, one chord", f"{figures.all_at_once_s:.1f} s", ""),
        ("scheduler overhead per shard", f"{figures.overhead_ms_per_shard:.2f} ms", "<= 5 ms"),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'fairness (' + str(figures.slots) + ' slots)':<{width}}  {'measured':>10}  target"]
    lines += [f"{name:<{width}}  {value:>10}  {target}" for name, value, target in rows]
    return "\n".join(lines)
