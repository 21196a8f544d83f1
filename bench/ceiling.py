"""The platform ceiling (`make bench`): jobs through the whole stack with a model that computes
nothing (`bench.engines.ZeroEmbedModel`, a fixed 384-float embedding a record), so that
what remains is Batchery's own cost.

Figures: records per second per slot of a 100,000-record job (submission to merged output, the
platform's own shard size), milliseconds per shard of a 1,000-shard job (one record a shard), the
bytes written to storage per record by the large job (shard inputs, shard outputs, merged output),
and where the time goes: each job run again under py-spy (attached to the control worker and the
launcher with their children; timings come from the runs without it), top functions by own time
and by time under them, in Batchery's code.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from django.conf import settings

from bench.catalog import bench_model_register
from bench.job import timed_job
from bench.py_spy import Profile, cpu_seconds_of, profile_while, render_profile, tree_cpu_seconds
from portal.catalog.models import Model
from portal.devstack.stack import Stack, StackOptions
from portal.execution.dispatch import job_queue
from portal.jobs.models import Job
from portal.jobs.storage_layout import job_root
from portal.tenancy.models import Tenant
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.storage.local import path_of

MODEL_NAME = "bench-zero-embed"
ONE_RECORD_JOBS = 30


@dataclass(frozen=True)
class CeilingFigures:
    slots: int
    records: int
    records_shards: int
    records_seconds: float
    shard_job_shards: int
    shard_job_seconds: float
    bytes_written: dict[str, int]
    """Bytes under the large job's root in storage, by kind."""
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    """CPU seconds each part of the stack spent on the one-record-shard job."""
    floor_tasks: int = 0
    floor_seconds: dict[int, float] = field(default_factory=dict)
    """Celery's own floor on the same workers: chord size -> seconds for `floor_tasks` no-op tasks sent in
    chords of that many with a no-op callback each: chords of one, and chords the size of the job's waves."""
    one_record_ms: list[float] = field(default_factory=list)
    """One-record jobs, one after another: each one's submission to its end, from its own row."""
    profiles: list[Profile] = field(default_factory=list)
    profile_note: str = ""

    @property
    def records_per_s_per_slot(self) -> float:
        return self.records / self.records_seconds / self.slots

    @property
    def ms_per_shard(self) -> float:
        return self.shard_job_seconds / self.shard_job_shards * 1000

    def floor_ms_per_task(self, chord_size: int) -> float:
        return self.floor_seconds[chord_size] / self.floor_tasks * 1000


def _records(path: Path, count: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        out.write(
            b"".join(orjson.dumps({"custom_id": f"r{n:07d}", "input": f"sentence {n}"}) + b"\n" for n in range(count))
        )
    return path


def _run_job(tenant: Tenant, path: Path, *, shard_size: int | None, timeout_s: float = 600) -> tuple[Job, float]:
    """Submit and wait for the end (`timed_job`, polled often: one-record jobs run one after another);
    the job and its seconds from the clock before `job_submit` to the end its row records."""
    job, seconds = timed_job(
        tenant=tenant, model_name=MODEL_NAME, dataset=path, shard_size=shard_size, timeout_s=timeout_s, poll_s=0.05
    )
    if job.status != "succeeded":
        raise RuntimeError(f"the zero-cost job ended {job.status}: {job.error}")
    return job, seconds


def bytes_written(job: Job) -> dict[str, int]:
    """Bytes under the job's root by kind; empty where storage is not `file://`."""
    if not job.output_uri.startswith("file://"):
        return {}
    root = path_of(job_root(job))
    kinds: Counter[str] = Counter()
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        top = path.relative_to(root).parts[0]
        kind = {"input": "shard inputs", "shards": "shard outputs and markers"}.get(top, "merged output and rest")
        kinds[kind] += path.stat().st_size
    return dict(kinds)


def _drop_objects(job: Job) -> None:
    """Remove a measured job's objects: a 100,000-record output of 384 floats a record is hundreds of MB."""
    if job.output_uri.startswith("file://"):
        shutil.rmtree(path_of(job_root(job)), ignore_errors=True)


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of the control worker and the launcher (each with its children), and of
    every Redis and PostgreSQL server process on the machine."""
    import psutil

    groups = {name: tree_cpu_seconds(stack.processes[name].pid) for name in ("control", "gpuworkers")}
    for name, binary in (("redis", "redis-server"), ("postgres", "postgres")):
        groups[name] = sum(
            cpu_seconds_of(process) for process in psutil.process_iter(["name"]) if process.info["name"] == binary
        )
    return groups


def celery_floor(tasks: int, *, queue: str, chord_size: int = 1, timeout_s: float = 300) -> float:
    """Seconds for `tasks` no-op tasks on `queue` sent in chords of `chord_size`, each with a no-op callback
    on the control queue (Celery's built-in `celery.accumulate`), all sent at once, on the running workers:
    what Celery itself costs a shard there, with nothing of Batchery's in the tasks."""
    from celery import chord, group

    from tasks.app import app
    from tasks.shared.config import CONTROL_QUEUE

    accumulate = app.signature("celery.accumulate")
    started = time.perf_counter()
    results = [
        chord(
            group([accumulate.clone((n,)).set(queue=queue) for n in range(start, min(start + chord_size, tasks))]),
            accumulate.clone((start,)).set(immutable=True, queue=CONTROL_QUEUE),
        ).apply_async()
        for start in range(0, tasks, chord_size)
    ]
    deadline = time.monotonic() + timeout_s
    for result in results:
        result.get(timeout=max(deadline - time.monotonic(), 0.1), interval=0.01)
    return time.perf_counter() - started


def wave_of(job: Job) -> int:
    """The largest chord (wave) the scheduler sent the job's shards in, from the shards' estimates."""
    from portal.execution.capacity import wave_size

    shard = job.shards.order_by("-estimated_seconds").first()
    seconds = shard.estimated_seconds if shard is not None else None
    return wave_size(job_queue(job), seconds)


def run_ceiling_bench(
    *, slots: int = 2, records: int = 100_000, shards: int = 1000, profile: bool = True, say: Callable[[str], None]
) -> CeilingFigures:
    data = Path(settings.VAR_DIR) / "bench" / "ceiling"
    bench_model_register(name=MODEL_NAME, task=Model.Task.EMBED, factory="zero_embed_factory", default_params={})
    tenant = tenant_get_or_create(name="bench-ceiling")
    big = _records(data / f"records-{records}.jsonl", records)
    one_a_shard = _records(data / f"records-{shards}.jsonl", shards)
    warmup = _records(data / "warmup.jsonl", 2000)
    stack = Stack(StackOptions(portal=False, flower=False, cpu_slots=slots, logs_to_files=True))
    stack.start()
    profiles: list[Profile] = []
    note = ""
    try:
        stack.wait_for_workers(queues={"control", "planning", "gpu.cpu"})
        time.sleep(6)  # the slots' first heartbeats, from which the scheduler sizes its window
        say("ceiling: warming the slots up ...")
        _run_job(tenant, warmup, shard_size=100)
        say(f"ceiling: {records:,} records, zero-cost model, {slots} slots ...")
        job, records_seconds = _run_job(tenant, big, shard_size=None)
        written = bytes_written(job)
        _drop_objects(job)
        say(f"ceiling: {shards:,} shards of one record ...")
        before = cpu_seconds(stack)
        shard_job, shard_seconds = _run_job(tenant, one_a_shard, shard_size=1)
        after = cpu_seconds(stack)
        cpu = {name: after[name] - before.get(name, 0.0) for name in after}
        floor_seconds = {}
        for chord_size in sorted({1, wave_of(shard_job)}):
            say(f"ceiling: Celery's floor, {shards:,} no-op tasks in chords of {chord_size} on the same workers ...")
            floor_seconds[chord_size] = celery_floor(shards, queue="gpu.cpu", chord_size=chord_size)
        say(f"ceiling: {ONE_RECORD_JOBS} one-record jobs, one after another ...")
        one_record = _records(data / "records-1.jsonl", 1)
        one_record_ms = [_run_job(tenant, one_record, shard_size=None)[1] * 1000 for _ in range(ONE_RECORD_JOBS)]
        if profile:
            say("ceiling: both jobs again under py-spy ...")
            try:
                pids = {name: stack.processes[name].pid for name in ("control", "gpuworkers")}
                profiles.append(
                    profile_while(
                        pids,
                        f"the {records:,} records job",
                        lambda: _drop_objects(_run_job(tenant, big, shard_size=None)[0]),
                        data / "profile-records",
                    )
                )
                profiles.append(
                    profile_while(
                        pids,
                        f"the {shards:,} one-record shards job",
                        lambda: _run_job(tenant, one_a_shard, shard_size=1),
                        data / "profile-shards",
                    )
                )
            except (OSError, RuntimeError) as exc:
                note = f"no profile: {exc}"
    finally:
        stack.stop()
    return CeilingFigures(
        slots=slots,
        records=records,
        records_shards=job.shard_count,
        records_seconds=records_seconds,
        shard_job_shards=shard_job.shard_count,
        shard_job_seconds=shard_seconds,
        bytes_written=written,
        cpu_seconds=cpu,
        floor_tasks=shards,
        floor_seconds=floor_seconds,
        one_record_ms=one_record_ms,
        profiles=profiles,
        profile_note=note,
    )


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def render_ceiling(figures: CeilingFigures) -> str:
    total_bytes = sum(figures.bytes_written.values())
    rows = [
        (
            f"{figures.records:,} records ({figures.records_shards} shards)",
            f"{figures.records_seconds:.1f} s",
            "submission to merged output",
        ),
        ("records/s per slot", f"{figures.records_per_s_per_slot:,.0f}", ">= 15,000"),
        (f"{figures.shard_job_shards:,} one-record shards", f"{figures.shard_job_seconds:.1f} s", ""),
        ("ms per shard", f"{figures.ms_per_shard:.2f}", "<= 5 ms"),
        *(
            (f"  CPU ms per shard, {name}", f"{seconds / figures.shard_job_shards * 1000:.2f}", "")
            for name, seconds in sorted(figures.cpu_seconds.items())
        ),
        *(
            (
                f"Celery's floor, ms per task, chords of {size}",
                f"{figures.floor_ms_per_task(size):.2f}",
                f"{figures.floor_tasks:,} no-op tasks, a no-op callback a chord, same workers",
            )
            for size in sorted(figures.floor_seconds)
        ),
        (
            "one-record job, p50 / p99 ms",
            f"{_percentile(figures.one_record_ms, 0.5):.0f} / {_percentile(figures.one_record_ms, 0.99):.0f}",
            f"p50 <= 100 ms; {len(figures.one_record_ms)} jobs, submission to end",
        ),
        ("bytes written per record", f"{total_bytes / figures.records:,.0f}", "all objects under the job's root"),
    ]
    rows += [
        (f"  {kind}", f"{size / figures.records:,.0f}", "bytes per record")
        for kind, size in sorted(figures.bytes_written.items())
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [
        f"{'platform ceiling (' + str(figures.slots) + ' slots, zero-cost model)':<{width}}  {'measured':>10}  target"
    ]
    lines += [f"{name:<{width}}  {value:>10}  {target}" for name, value, target in rows]
    for profile in figures.profiles:
        lines += render_profile(profile)
    if figures.profile_note:
        lines.append(figures.profile_note)
    return "\n".join(lines)
