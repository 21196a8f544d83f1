"""A simulated fleet for the scheduler's end-to-end tests: CPU slots stand in for GPUs and a
sleep-based model (1 ms a record) makes timings mean something on two cores.

Each test gets its own stack (embedded Redis, a control worker with beat, four slot workers that
send heartbeats as the launcher's do) and measures from the shards' own start and end times.
Figures are appended to test-artifacts/scheduling.md.
"""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import Model
from portal.execution import capacity
from portal.jobs.models import FINAL_STATUSES, Job, Shard
from tasks.shared.config import gpu_queue
from tests.chaos.conftest import ARTIFACTS, wait_consuming
from tests.factories import GpuClassFactory, ModelFactory
from tests.support.chaos import CHAOS_ENV, ChaosStack, wait_for, write_records
from tests.support.workers import database_url

SLOTS = 4
SECONDS_PER_RECORD = 0.001
HALF_LIFE_S = 20
REPORT = ARTIFACTS / "scheduling.md"


@pytest.fixture
def sim(transactional_db: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ChaosStack]:
    from django.db import connection

    env = {
        **os.environ,
        **CHAOS_ENV,
        "DATABASE_URL": database_url(connection.settings_dict),
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "BATCHERY_TARGET_SHARD_SECONDS": "1",
        "BATCHERY_FAIR_SHARE_HALF_LIFE_S": str(HALF_LIFE_S),
    }
    stack = ChaosStack(env=env, data_dir=tmp_path / "sim", log_dir=ARTIFACTS / "sim-logs" / request.node.name)
    stack.start_redis()
    try:
        stack.start_control()
        stack.start_slots(SLOTS)
        wait_consuming(stack)
        ModelFactory(
            name="fair-echo",
            engine=Model.Engine.PYTHON,
            task=Model.Task.CLASSIFY,
            source="tests.support.chaos_engines:echo_factory",
            default_params={
                "sleep_per_record": SECONDS_PER_RECORD,
                "seconds_per_record": SECONDS_PER_RECORD,
                "time_limit_base_s": 60,
                "time_limit_per_record_s": 0.01,
            },
            is_default=False,
        )
        yield stack
    finally:
        stack.stop()


def submit(sim: ChaosStack, tmp_path: Path, tenant: str, records: int, *extra: str) -> tuple[str, list[str], float]:
    path = tmp_path / f"{tenant}-{time.monotonic_ns()}.jsonl"
    ids = write_records(path, [f"record {n:07d}" for n in range(records)])
    submitted = time.time()
    return sim.submit(model="fair-echo", input_path=path, shard_size=None, tenant=tenant, extra=extra), ids, submitted


def wait_status(job_id: str, statuses: set[str], timeout_s: float, sim: ChaosStack) -> Job:
    job: Job = wait_for(
        lambda: (job := Job.objects.get(pk=job_id)).status in statuses and job,
        timeout_s=timeout_s,
        what=f"job {job_id} to be {statuses}",
        stack=sim,
    )
    return job


def ended(job_id: str, sim: ChaosStack, timeout_s: float = 240) -> Job:
    return wait_status(job_id, set(FINAL_STATUSES), timeout_s, sim)


def ts(moment: dt.datetime) -> float:
    return moment.timestamp()


def finished_shards(*job_ids: str) -> dict[str, list[Shard]]:
    return {job_id: list(Shard.objects.filter(job_id=job_id, finished_at__isnull=False)) for job_id in job_ids}


def report(title: str, rows: list[tuple[str, str]]) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    with REPORT.open("a") as out:
        out.write(f"\n### {title}\n\n| measure | value |\n|---|---|\n")
        out.writelines(f"| {name} | {value} |\n" for name, value in rows)


@pytest.fixture
def gpu_class() -> Iterator[Any]:
    """A class of its own, so that its queue holds only this test's messages; emptied afterwards."""
    from tasks.app import app

    gpu_class = GpuClassFactory(name=f"sched{uuid.uuid4().hex[:8]}")
    capacity._cached = None
    yield gpu_class
    with app.connection_for_write() as connection:
        connection.SimpleQueue(gpu_queue(gpu_class.name)).clear()
    capacity._cached = None
