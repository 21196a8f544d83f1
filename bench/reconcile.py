"""The reconciler's cost at fleet size (`make bench`): one `jobs_reconcile()` over 100 running jobs
of 1,000 dispatched shards each.

Rows and fleet are simulated: the shards are created with `bulk_create`; most are held by a live
lease, and `committed_fraction` of those have already written their commit marker (their callbacks
are on the way); `lost` shards were sent long ago and have no lease and no message, half of them
committed (their callback was lost) and half not (their message was lost). Storage requests are
counted by wrapping the `file://` store's methods in this process (`count_storage_requests`); the
sweep reads the markers of the lost shards only, whatever the number of shards running.
"""

from __future__ import annotations

import datetime as dt
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from django.utils import timezone

from bench.catalog import bench_class_model
from portal.catalog.models import Model
from portal.catalog.services import catalog_publish
from portal.execution.reconcile import jobs_reconcile
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.leases import shard_lease_key
from tasks.shared.redis_client import redis_client
from tasks.shared.specs import ShardManifest, commit_uri
from tasks.shared.storage import store_for
from tasks.shared.storage.local import LocalStore

GPU_CLASS = "bench-reconcile"
TENANT = "bench-reconcile"
RECORDS_PER_SHARD = 10
# Every request a store can make; `read_bytes` is left out because it reads through `open_read`.
STORE_METHODS = ("exists", "open_read", "size", "list_prefix", "open_write", "put_if_absent", "delete_prefix")


@dataclass(frozen=True)
class ReconcileFigures:
    jobs: int
    shards_per_job: int
    committed_held: int
    """Shards held by a live lease that have committed (the sweep leaves them to their callbacks)."""
    lost: int
    """Shards sent long ago with no lease and no message: the sweep's real work."""
    storage_requests: int
    by_method: dict[str, int]
    seconds: float
    settled: int
    """Shards the sweep found committed."""
    resent: int


@contextmanager
def count_storage_requests(*, under: str = "") -> Iterator[Counter[str]]:
    """Count the calls to the `file://` store's methods in this process for URIs starting with
    `under`, by method name."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(LocalStore, name) for name in STORE_METHODS}

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(method)
        def call(store: LocalStore, uri: str, *args: Any, **kwargs: Any) -> Any:
            if uri.startswith(under):
                counts[name] += 1
            return method(store, uri, *args, **kwargs)

        return call

    for name, method in originals.items():
        setattr(LocalStore, name, counted(name, method))
    try:
        yield counts
    finally:
        for name, method in originals.items():
            setattr(LocalStore, name, method)


def write_commit(shard: Shard, *, compute_seconds: float = 1.0, pid: int = 1) -> None:
    """The commit marker a finished attempt of `shard` (by process `pid`) writes, accounting for all of its records."""
    now = time.time()
    manifest = ShardManifest(
        job_id=str(shard.job_id),
        shard_index=shard.index,
        attempt_id=uuid.uuid4().hex,
        worker="bench@sim",
        pid=pid,
        output_uri=shard.prefix_uri + "/out.jsonl",
        errors_uri=shard.prefix_uri + "/errors.jsonl",
        records=shard.record_count,
        succeeded=shard.record_count,
        failed=0,
        started_at=now - compute_seconds,
        finished_at=now,
        compute_seconds=compute_seconds,
        load_seconds=0.0,
        cache_hit=True,
        model_loads=0,
    )
    uri = commit_uri(shard.prefix_uri)
    store_for(uri).put_if_absent(uri, orjson.dumps(manifest.to_dict()))


def _model() -> Model:
    return bench_class_model(name="bench-reconcile", gpu_class=GPU_CLASS)


def simulate_running_jobs(
    *, root: Path, jobs: int, shards_per_job: int, sent_at: dt.datetime, model: Model | None = None
) -> list[Job]:
    """`jobs` running jobs whose shards are all dispatched at `sent_at`, inputs and commits under `root`."""
    model = model or _model()
    tenant = tenant_get_or_create(name=TENANT)
    created = Job.objects.bulk_create(
        Job(
            tenant=tenant,
            model=model,
            status=JobStatus.RUNNING,
            input_uri=(root / "input.jsonl").as_uri(),
            output_uri=(root / f"output-{n}.jsonl").as_uri(),
            shard_size=RECORDS_PER_SHARD,
            shard_count=shards_per_job,
            total_records=shards_per_job * RECORDS_PER_SHARD,
        )
        for n in range(jobs)
    )
    for job in created:
        Shard.objects.bulk_create(
            (
                Shard(
                    job=job,
                    index=index,
                    first_record=index * RECORDS_PER_SHARD,
                    record_count=RECORDS_PER_SHARD,
                    estimated_seconds=1.0,
                    input_uri=(root / str(job.pk) / f"shard-{index}" / "input.jsonl").as_uri(),
                    prefix_uri=(root / str(job.pk) / f"shard-{index}").as_uri(),
                    status=ShardStatus.DISPATCHED,
                    task_id=f"bench-{job.pk}-{index}",
                    dispatched_at=sent_at,
                    attempt=1,
                )
                for index in range(shards_per_job)
            ),
            batch_size=2000,
        )
    return created


def hold_leases(shards: list[tuple[str, int]], *, ttl_s: int) -> list[str]:
    """Live leases on `(job_id, index)` shards, as running attempts keep; returns the keys."""
    keys = [shard_lease_key(job_id, index) for job_id, index in shards]
    pipe = redis_client().pipeline(transaction=False)
    for key in keys:
        pipe.set(key, "bench@sim", ex=ttl_s)
    pipe.execute()
    return keys


def run_reconcile_bench(
    *, jobs: int = 100, shards_per_job: int = 1000, committed_fraction: float = 0.03, lost: int = 100
) -> ReconcileFigures:
    root = Path(settings.VAR_DIR) / "bench" / "reconcile"
    shutil.rmtree(root, ignore_errors=True)
    tenant = tenant_get_or_create(name=TENANT)
    Job.objects.filter(tenant=tenant).delete()
    created = simulate_running_jobs(
        root=root, jobs=jobs, shards_per_job=shards_per_job, sent_at=timezone.now() - dt.timedelta(minutes=10)
    )
    catalog_publish()  # the bench model reaches the catalog now, not during the measured sweep
    total = jobs * shards_per_job
    # Spread evenly: every `step`-th shard overall is lost, and every `commit_step`-th held one committed.
    step = max(1, total // max(lost, 1)) if lost else total + 1
    commit_step = max(1, round(1 / committed_fraction)) if committed_fraction > 0 else total + 1
    held: list[tuple[str, int]] = []
    committed_held = lost_count = lost_committed = 0
    shards = Shard.objects.filter(job__in=created).only("id", "job_id", "index", "prefix_uri", "record_count")
    for position, shard in enumerate(shards.order_by("job_id", "index").iterator(chunk_size=5000)):
        if position % step == step - 1 and lost_count < lost:
            lost_count += 1
            if lost_count % 2:
                write_commit(shard)
                lost_committed += 1
            continue
        held.append((str(shard.job_id), shard.index))
        if position % commit_step == 0:
            write_commit(shard)
            committed_held += 1
    keys = hold_leases(held, ttl_s=600)
    try:
        with count_storage_requests() as counts:
            started = time.perf_counter()
            report = jobs_reconcile()
            seconds = time.perf_counter() - started
        settled = Shard.objects.filter(job__in=created, status=ShardStatus.SUCCEEDED).count()
    finally:
        client = redis_client()
        for start in range(0, len(keys), 10_000):
            client.delete(*keys[start : start + 10_000])
        Job.objects.filter(tenant=tenant).delete()
        shutil.rmtree(root, ignore_errors=True)
    return ReconcileFigures(
        jobs=jobs,
        shards_per_job=shards_per_job,
        committed_held=committed_held,
        lost=lost_count,
        storage_requests=sum(counts.values()),
        by_method=dict(counts),
        seconds=seconds,
        settled=settled,
        resent=report.resent_shards,
    )


def render_reconcile(figures: ReconcileFigures) -> str:
    shards = figures.jobs * figures.shards_per_job
    methods = ", ".join(f"{name} {count}" for name, count in sorted(figures.by_method.items())) or "none"
    rows = [
        ("dispatched shards swept", f"{shards:,}", f"{figures.jobs} jobs x {figures.shards_per_job:,}"),
        ("held by a live lease, committed", f"{figures.committed_held:,}", "left to their callbacks"),
        ("lost (no lease, no message)", f"{figures.lost:,}", "half of them committed"),
        ("storage requests in one sweep", f"{figures.storage_requests:,}", f"<= a few hundred ({methods})"),
        ("sweep duration", f"{figures.seconds:.2f} s", "< 2 s"),
        ("shards settled / sent again", f"{figures.settled} / {figures.resent}", ""),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'reconciler sweep':<{width}}  {'measured':>12}  target / note"]
    lines += [f"{name:<{width}}  {value:>12}  {note}" for name, value, note in rows]
    return "\n".join(lines)
