"""What a million finished shards cost PostgreSQL, and what the retention sweep gives back (`make bench`,
`manage.py bench --skip-io ... --retention-shards 1000000`).

Jobs that ended past the retention are made with their shard rows as a settled job leaves them (storage
URIs under an S3 job root, task and attempt ids, the worker, timings, tokens, a few error codes) and five
status events each, written by PostgreSQL itself (`INSERT ... SELECT` over `generate_series`). Sizes are
the growth of the shard and event tables (heap, indexes, total with TOAST and maps) over what they held
before, compacted (VACUUM FULL), so rows and free pages left by other runs do not count. Then
`jobs_prune` runs, sweep after sweep as the beat would send them, each DELETE timed; then a plain
VACUUM, what autovacuum does.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.utils import timezone

from portal.catalog.models import GpuClass, Model
from portal.jobs.models import Job, JobEvent, JobStatus, Shard
from portal.jobs.services.retention import JOBS_PER_PASS, ROWS_PER_DELETE, jobs_due, jobs_prune, retention
from portal.tenancy.services import tenant_get_or_create

TENANT = "bench-retention"
RECORDS_PER_SHARD = 100
STORAGE_ROOT = "s3://batchery-data/batchery/jobs"
EVENTS = (JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.MERGING, JobStatus.SUCCEEDED)
TABLES = {"shards": Shard._meta.db_table, "events": JobEvent._meta.db_table}

# A settled shard's row: each column as the settle step writes it (`portal.execution.settle`), from the
# job (j), the shard's index (i) and its attempt's id (a.att).
SHARD_ROWS_SQL = """
INSERT INTO jobs_shard (
    job_id, "index", round, first_record, record_count, input_chars, estimated_seconds, input_uri, prefix_uri,
    status, task_id, speculative_task_id, slot_queue, dispatched_at, attempt, attempt_id, output_uri, errors_uri,
    succeeded_records, failed_records, prompt_tokens, completion_tokens, cached_prompt_tokens, worker, worker_pid,
    cache_hit, started_at, finished_at, compute_seconds, load_seconds, error_codes, adapter_usage, provenance, error
)
SELECT
    j.id, i, 0, i * %(records)s, %(records)s, %(records)s * 160, 18.0 + (i %% 7), p.root || '/input/shard-'
    || lpad(i::text, 5, '0') || '.jsonl', p.root || '/shards/' || lpad(i::text, 5, '0'),
    'succeeded', 'shard-' || j.id::text || '-' || i || '-' || substr(a.att, 1, 12), '', '',
    j.finished_at - interval '10 minutes', 1, a.att,
    p.root || '/shards/' || lpad(i::text, 5, '0') || '/attempts/' || a.att || '.output.jsonl',
    p.root || '/shards/' || lpad(i::text, 5, '0') || '/attempts/' || a.att || '.errors.jsonl',
    %(records)s - (CASE WHEN i %% 20 = 0 THEN 2 ELSE 0 END), CASE WHEN i %% 20 = 0 THEN 2 ELSE 0 END,
    %(records)s * 40 + i %% 97, 0, 0, 'slot-' || (i %% 8) || '@gpu-host-' || lpad((i / 8 %% 125)::text, 3, '0'),
    1000 + i %% 30000, true, j.finished_at - interval '9 minutes', j.finished_at - interval '8 minutes',
    17.5 + (i %% 11) / 10.0, CASE WHEN i %% 50 = 0 THEN 4.2 ELSE 0.0 END,
    CASE WHEN i %% 20 = 0 THEN '{"invalid_request": 2}'::jsonb ELSE '{}'::jsonb END, '{}'::jsonb, '{}'::jsonb, ''
FROM jobs_job j
CROSS JOIN LATERAL (SELECT %(root)s || '/' || j.id::text AS root) p
CROSS JOIN generate_series(0, %(per_job)s - 1) i
CROSS JOIN LATERAL (SELECT md5(j.id::text || ':' || i) AS att) a
WHERE j.id = ANY(%(jobs)s)
"""
EVENT_ROWS_SQL = """
INSERT INTO jobs_jobevent (job_id, status, at)
SELECT j.id, e.status, j.finished_at - (interval '1 minute' * (%(steps)s - e.n))
FROM jobs_job j CROSS JOIN unnest(%(statuses)s::text[]) WITH ORDINALITY AS e(status, n)
WHERE j.id = ANY(%(jobs)s)
"""


@dataclass(frozen=True)
class Sizes:
    """Bytes of one table: its heap, its indexes, and all of it (with TOAST and the free-space maps)."""

    heap: int
    indexes: int
    total: int

    def minus(self, other: Sizes) -> Sizes:
        return Sizes(self.heap - other.heap, self.indexes - other.indexes, self.total - other.total)


@dataclass
class RetentionFigures:
    shards: int
    jobs: int
    events: int
    insert_s: float
    grown: dict[str, Sizes]
    """Each table's growth by the rows made."""
    due_plan: str
    """How PostgreSQL reads the jobs table to find the sweep's next jobs (its plan's scan)."""
    sweep_s: float = 0.0
    sweeps: int = 0
    deletes: int = 0
    median_delete_s: float = 0.0
    longest_delete_s: float = 0.0
    removed_shards: int = 0
    removed_events: int = 0
    after_sweep: dict[str, Sizes] = field(default_factory=dict)
    """Each table's size after the sweep, over what it held before the rows were made."""
    after_vacuum: dict[str, Sizes] = field(default_factory=dict)

    @property
    def shards_per_s(self) -> float:
        return self.removed_shards / self.sweep_s if self.sweep_s else 0.0


def table_sizes() -> dict[str, Sizes]:
    sizes = {}
    with connection.cursor() as cursor:
        for name, table in TABLES.items():
            cursor.execute(
                "SELECT pg_relation_size(t), pg_indexes_size(t), pg_total_relation_size(t) FROM CAST(%s AS regclass) t",
                [table],
            )
            heap, indexes, total = cursor.fetchone()
            sizes[name] = Sizes(heap=heap, indexes=indexes, total=total)
    return sizes


def _grown(now: dict[str, Sizes], before: dict[str, Sizes]) -> dict[str, Sizes]:
    return {name: now[name].minus(before[name]) for name in TABLES}


def _run(sql: str, params: dict[str, Any] | None = None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def _model() -> Model:
    gpu_class, _ = GpuClass.objects.get_or_create(name="bench-retention")
    model, _ = Model.objects.update_or_create(
        name="bench-retention",
        version="1",
        defaults={
            "engine": Model.Engine.PYTHON,
            "task": Model.Task.EMBED,
            "source": "bench.engines:sleep_factory",
            "gpu_class": gpu_class,
            "is_default": False,
        },
    )
    return model


def _clear(tenant_id: int) -> None:
    """Remove the bench's jobs with their rows, in SQL: the ORM's cascade would read a million rows first."""
    for table in ("jobs_shard", "jobs_jobevent", "jobs_jobusage"):
        _run(f"DELETE FROM {table} WHERE job_id IN (SELECT id FROM jobs_job WHERE tenant_id = %(t)s)", {"t": tenant_id})
    _run("DELETE FROM jobs_job WHERE tenant_id = %(t)s", {"t": tenant_id})


def _scan(plan: str) -> str:
    """The line of a plan that says how the table is read."""
    return next((line.strip(" ->") for line in plan.splitlines() if "Scan" in line), plan.splitlines()[0])


@contextmanager
def timed_deletes() -> Iterator[list[float]]:
    """The duration of each DELETE on the shard table run in this connection meanwhile."""
    durations: list[float] = []

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if not sql.startswith('DELETE FROM "jobs_shard"'):
            return execute(sql, params, many, context)
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            durations.append(time.perf_counter() - started)

    with connection.execute_wrapper(wrapper):
        yield durations


def run_retention_bench(
    *, shards: int = 1_000_000, jobs: int = 1_000, say: Callable[[str], None] = print
) -> RetentionFigures:
    kept_for = retention() or dt.timedelta(days=30)
    now = timezone.now()
    tenant = tenant_get_or_create(name=TENANT)
    _clear(tenant.pk)
    # Compacted first: free pages that an earlier run left in the indexes would take the new entries
    # and hide their size. The bench's database only: VACUUM FULL locks the tables while it rewrites them.
    _run(f"VACUUM FULL {TABLES['shards']}, {TABLES['events']}")
    before = table_sizes()
    per_job = max(1, shards // jobs)
    ended = now - kept_for - dt.timedelta(days=2)
    model = _model()
    created = Job.objects.bulk_create(
        Job(
            id=uuid.uuid4(),
            tenant=tenant,
            model=model,
            status=JobStatus.SUCCEEDED,
            input_uri=f"{STORAGE_ROOT}/uploads/{n}.jsonl",
            output_uri=f"{STORAGE_ROOT}/{n}/output.jsonl",
            total_records=per_job * RECORDS_PER_SHARD,
            succeeded_records=per_job * RECORDS_PER_SHARD,
            shard_count=per_job,
            started_at=ended - dt.timedelta(minutes=30),
            finished_at=ended - dt.timedelta(seconds=n),
        )
        for n in range(jobs)
    )
    ids = [job.pk for job in created]
    say(f"retention: writing {per_job * jobs:,} settled shard rows of {jobs:,} jobs ...")
    started = time.perf_counter()
    for start in range(0, jobs, 100):
        chunk = ids[start : start + 100]
        _run(SHARD_ROWS_SQL, {"records": RECORDS_PER_SHARD, "root": STORAGE_ROOT, "per_job": per_job, "jobs": chunk})
        _run(EVENT_ROWS_SQL, {"steps": len(EVENTS), "statuses": [str(status) for status in EVENTS], "jobs": chunk})
    insert_s = time.perf_counter() - started
    _run(f"ANALYZE {TABLES['shards']}, {TABLES['events']}, {Job._meta.db_table}")
    figures = RetentionFigures(
        shards=Shard.objects.filter(job__tenant=tenant).count(),
        jobs=jobs,
        events=JobEvent.objects.filter(job__tenant=tenant).count(),
        insert_s=insert_s,
        grown=_grown(table_sizes(), before),
        due_plan=_scan(jobs_due(now=now).values_list("pk", flat=True)[:JOBS_PER_PASS].explain()),
    )
    say(f"retention: sweeping them, {ROWS_PER_DELETE:,} rows a DELETE ...")
    try:
        with timed_deletes() as durations:
            started = time.perf_counter()
            while (report := jobs_prune(now=now)).jobs or report.shards:
                figures.sweeps += 1
                figures.removed_shards += report.shards
                figures.removed_events += report.events
                figures.deletes += report.deletes
            figures.sweep_s = time.perf_counter() - started
        figures.median_delete_s = statistics.median(durations) if durations else 0.0
        figures.longest_delete_s = max(durations, default=0.0)
        figures.after_sweep = _grown(table_sizes(), before)
        _run(f"VACUUM {TABLES['shards']}, {TABLES['events']}")
        figures.after_vacuum = _grown(table_sizes(), before)
    finally:
        _clear(tenant.pk)
    return figures


def _mb(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def render_retention(figures: RetentionFigures) -> str:
    per_million = 1_000_000 / max(figures.shards, 1)
    shards, events = figures.grown["shards"], figures.grown["events"]
    rows = [
        ("shard rows written", f"{figures.shards:,}", f"{figures.jobs:,} jobs, in {figures.insert_s:.1f} s"),
        ("shards: heap", _mb(shards.heap), f"{shards.heap / max(figures.shards, 1):,.0f} bytes a row"),
        ("shards: indexes", _mb(shards.indexes), f"{shards.indexes / max(figures.shards, 1):,.0f} bytes a row"),
        ("shards: total per million", _mb(round(shards.total * per_million)), "heap, indexes, TOAST and maps"),
        ("event rows written", f"{figures.events:,}", f"{figures.events // max(figures.jobs, 1)} a job"),
        ("events: total", _mb(events.total), f"{events.total / max(figures.events, 1):,.0f} bytes a row"),
        ("next jobs to prune: plan", "", figures.due_plan),
        ("sweep", f"{figures.sweep_s:.1f} s", f"{figures.sweeps} sweeps of at most a minute, as the beat sends them"),
        ("shard rows removed", f"{figures.removed_shards:,}", f"{figures.shards_per_s:,.0f} rows/s"),
        (
            "DELETE statements",
            f"{figures.deletes:,}",
            f"median {figures.median_delete_s * 1000:.0f} ms, longest {figures.longest_delete_s * 1000:.0f} ms",
        ),
        ("event rows removed", f"{figures.removed_events:,}", "kept in Job.timeline"),
        ("shards after the sweep", _mb(figures.after_sweep["shards"].total), "dead rows, reused by new ones"),
        ("shards after VACUUM", _mb(figures.after_vacuum["shards"].total), "what autovacuum leaves"),
        ("events after VACUUM", _mb(figures.after_vacuum["events"].total), ""),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'retention':<{width}}  {'measured':>14}  note"]
    lines += [f"{name:<{width}}  {value:>14}  {note}" for name, value, note in rows]
    return "\n".join(lines)
