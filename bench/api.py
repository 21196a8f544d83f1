"""The API under load (`make bench`): 50 concurrent clients reading one job's status and the job
list from the portal as deployed (gunicorn, `portal.devstack.stack`), with 10,000 jobs in the database.

Each client alternates `GET /api/v1/jobs/{id}/` and `GET /api/v1/jobs/` for `seconds`, waiting
about `pace_s` between its requests (0: as fast as the portal answers, which measures its capacity: the
latency is then the clients' queue, by Little's law, more than any request's work). The waits are
drawn at random (exponential, mean `pace_s`, after a random start), as independent users poll: clients
in lockstep would all ask at the same instant and measure the queue of their own burst. Reported: p50
and p99 latency per endpoint, requests per second, errors (any answer but 200, or none), and the
database queries each endpoint makes, counted in this process with Django's test client; the CPU the
portal (gunicorn and its workers) and the clients (this process) spent in each run, which says what
bounds the unpaced run on a machine that holds both. Then the run with no pause again under py-spy,
attached to gunicorn and its workers: where the portal's time goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from bench.py_spy import Profile, profile_while, render_profile, tree_cpu_seconds
from portal.catalog.models import GpuClass, Model
from portal.devstack.embedded import free_port
from portal.devstack.stack import Stack, StackOptions
from portal.jobs.models import Job, JobStatus
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Membership, Tenant
from portal.tenancy.services import membership_add, tenant_get_or_create

TENANT = "bench-api"
LIST = "/api/v1/jobs/"


@dataclass(frozen=True)
class LoadRun:
    pace_s: float
    seconds: float
    latencies_ms: dict[str, list[float]]
    """Latencies by endpoint (`detail`, `list`), in milliseconds."""
    errors: int
    portal_cpu_s: float = 0.0
    """CPU seconds of gunicorn and its workers during the run."""
    clients_cpu_s: float = 0.0
    """CPU seconds of the clients (this process) during the run."""

    @property
    def requests(self) -> int:
        return sum(len(values) for values in self.latencies_ms.values())

    def percentile(self, endpoint: str, fraction: float) -> float:
        values = sorted(self.latencies_ms[endpoint])
        return values[min(len(values) - 1, int(fraction * len(values)))] if values else float("nan")


@dataclass(frozen=True)
class ApiFigures:
    jobs: int
    clients: int
    portal_workers: int
    runs: list[LoadRun]
    queries: dict[str, int]
    """Database queries per request, by endpoint."""
    profile: Profile | None = None
    """The run with no pause again, under py-spy attached to the portal."""
    profile_note: str = ""


def _seed(jobs: int) -> tuple[Tenant, str, str]:
    """The tenant with `jobs` jobs (one in ten running, the rest ended), a key for it, and one job's id.

    The rows are removed at the end (`run_api_bench`): running jobs without shards would have the
    reconciler of a later stack send their merges."""
    tenant = tenant_get_or_create(name=TENANT)
    membership = Membership.objects.filter(tenant=tenant).first() or membership_add(
        tenant=tenant, username=f"{TENANT}-reader", role=Membership.Role.MEMBER, actor_role=Membership.Role.OWNER
    )
    _, key = apikey_create(tenant=tenant, user=membership.user)
    Job.objects.filter(tenant=tenant).delete()
    if jobs:
        gpu_class, _ = GpuClass.objects.get_or_create(name="cpu")
        model, _ = Model.objects.get_or_create(
            name="bench-api",
            version="1",
            defaults={
                "engine": Model.Engine.PYTHON,
                "task": Model.Task.EMBED,
                "source": "bench.engines:zero_embed_factory",
                "gpu_class": gpu_class,
                "enabled": False,
            },
        )
        Job.objects.bulk_create(
            (
                Job(
                    tenant=tenant,
                    model=model,
                    status=JobStatus.RUNNING if n % 10 == 0 else JobStatus.SUCCEEDED,
                    input_uri=f"file:///bench/api/{n}.jsonl",
                    output_uri=f"file:///bench/api/{n}/output.jsonl",
                    total_records=1000,
                    succeeded_records=1000 if n % 10 else 0,
                    shard_count=10,
                )
                for n in range(jobs)
            ),
            batch_size=2000,
        )
        if connection.vendor == "postgresql":
            # Fresh statistics and no dead rows, as autovacuum would leave them: planned on stale statistics a
            # page sorts every job, and the dead rows of earlier runs' jobs slowed each later run's reads.
            with connection.cursor() as cursor:
                cursor.execute(f"VACUUM ANALYZE {Job._meta.db_table}")
    job = Job.objects.filter(tenant=tenant, status=JobStatus.RUNNING).order_by("-created_at").first()
    assert job is not None
    return tenant, key, str(job.pk)


def queries_per_request(key: str, job_id: str) -> dict[str, int]:
    """Database queries of one detail and one list request, through Django's test client in this process."""
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="localhost")
    counts = {}
    for endpoint, path in (("detail", f"{LIST}{job_id}/"), ("list", LIST)):
        client.get(path)  # the key's `last_used_at` write happens once, not on every request
        with CaptureQueriesContext(connection) as captured:
            response = client.get(path)
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered {response.status_code}: {response.content[:200]!r}")
        counts[endpoint] = len(captured.captured_queries)
    return counts


async def _load(base_url: str, key: str, job_id: str, *, clients: int, seconds: float, pace_s: float) -> LoadRun:
    latencies: dict[str, list[float]] = {"detail": [], "list": []}
    errors = 0
    waits = random.Random(0)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=30) as client:
        deadline = time.perf_counter() + seconds

        async def one_client(offset: int) -> None:
            nonlocal errors
            turn = offset
            if pace_s:
                await asyncio.sleep(waits.uniform(0, pace_s))
            while time.perf_counter() < deadline:
                endpoint, path = ("detail", f"{LIST}{job_id}/") if turn % 2 == 0 else ("list", LIST)
                turn += 1
                started = time.perf_counter()
                try:
                    response = await client.get(path)
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies[endpoint].append((time.perf_counter() - started) * 1000)
                errors += not ok
                if pace_s:
                    await asyncio.sleep(waits.expovariate(1 / pace_s))

        started = time.perf_counter()
        await asyncio.gather(*(one_client(n) for n in range(clients)))
        elapsed = time.perf_counter() - started
    return LoadRun(pace_s=pace_s, seconds=elapsed, latencies_ms=latencies, errors=errors)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The clients' own garbage collections would stall every request in flight (a full one took 80 ms
    here) and count as the portal's latency: paused while they run."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def wait_ready(base_url: str, stack: Stack, timeout_s: float = 60) -> None:
    """Block until the stack's portal at `base_url` answers its health check."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the portal did not answer on {base_url} within {timeout_s:.0f}s")


def run_api_bench(
    *,
    jobs: int = 10_000,
    clients: int = 50,
    seconds: float = 10.0,
    paces_s: tuple[float, ...] = (0.0, 0.5),
    portal_workers: int = StackOptions.portal_workers,
    profile: bool = True,
    say: Callable[[str], None],
) -> ApiFigures:
    # httpx logs each request at INFO: half a million lines would drown the table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    say(f"api: {jobs:,} jobs in the database ...")
    tenant, key, job_id = _seed(jobs)
    address = f"127.0.0.1:{free_port()}"
    options = StackOptions(
        portal=True,
        portal_address=address,
        portal_workers=portal_workers,
        flower=False,
        workers=False,
        logs_to_files=True,
    )
    stack = Stack(options)
    runs = []
    measured: Profile | None = None
    note = ""
    try:
        queries = queries_per_request(key, job_id)
        stack.start()
        base_url = f"http://{address}"
        wait_ready(base_url, stack)
        asyncio.run(_load(base_url, key, job_id, clients=clients, seconds=1.0, pace_s=0.0))  # warm connections
        portal_pid = stack.processes["portal"].pid
        for pace_s in paces_s:
            say(f"api: {clients} clients for {seconds:.0f} s, {pace_s * 1000:.0f} ms between a client's requests ...")
            portal_before, clients_before = tree_cpu_seconds(portal_pid), time.process_time()
            with _collector_paused():
                run = asyncio.run(_load(base_url, key, job_id, clients=clients, seconds=seconds, pace_s=pace_s))
            runs.append(
                dataclasses.replace(
                    run,
                    portal_cpu_s=tree_cpu_seconds(portal_pid) - portal_before,
                    clients_cpu_s=time.process_time() - clients_before,
                )
            )
        if profile:
            say(f"api: {clients} clients for {seconds:.0f} s with no pause again, under py-spy ...")
            try:
                with _collector_paused():
                    measured = profile_while(
                        {"portal": portal_pid},
                        f"the portal, {clients} clients with no pause",
                        lambda: asyncio.run(_load(base_url, key, job_id, clients=clients, seconds=seconds, pace_s=0.0)),
                        Path(settings.VAR_DIR) / "bench" / "api" / "profile",
                    )
            except (OSError, RuntimeError) as exc:
                note = f"no profile: {exc}"
    finally:
        stack.stop()
        Job.objects.filter(tenant=tenant).delete()
    return ApiFigures(
        jobs=jobs,
        clients=clients,
        portal_workers=portal_workers,
        runs=runs,
        queries=queries,
        profile=measured,
        profile_note=note,
    )


def render_api(figures: ApiFigures) -> str:
    lines = [
        f"API: {figures.clients} clients, {figures.jobs:,} jobs in the database, "
        f"{figures.portal_workers} gunicorn workers; "
        f"queries per request: detail {figures.queries['detail']}, list {figures.queries['list']}"
    ]
    header = f"{'pace per client':<16} {'req/s':>7} {'errors':>6}  {'detail p50/p99':>16}  {'list p50/p99':>16}  target"
    lines.append(header)
    for run in figures.runs:
        pace = "none (capacity)" if not run.pace_s else f"{run.pace_s * 1000:.0f} ms"
        cells = [
            f"{run.percentile(endpoint, 0.5):6.1f} /{run.percentile(endpoint, 0.99):6.1f} ms"
            for endpoint in ("detail", "list")
        ]
        lines.append(
            f"{pace:<16} {run.requests / run.seconds:7.0f} {run.errors:6d}  {cells[0]:>16}  {cells[1]:>16}  "
            "p99 < 50 ms, no error"
        )
    for run in figures.runs:
        pace = "no pause" if not run.pace_s else f"{run.pace_s * 1000:.0f} ms between requests"
        lines.append(
            f"CPU with {pace}: portal {run.portal_cpu_s / run.seconds:.2f} cores, clients "
            f"{run.clients_cpu_s / run.seconds:.2f} cores (of {os.cpu_count()}); "
            f"portal {run.portal_cpu_s / max(run.requests, 1) * 1000:.2f} ms a request"
        )
    if figures.profile is not None:
        lines += render_profile(figures.profile)
    if figures.profile_note:
        lines.append(figures.profile_note)
    return "\n".join(lines)
