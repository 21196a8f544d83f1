"""Two real slot workers of one class, each consuming the class queue and its own: once one of them holds a
LoRA adapter (its heartbeat says so), the shards of the next job naming that adapter all run there, and
the other slot never loads it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from portal.catalog.models import Adapter, Model
from portal.execution import capacity
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.ops.selectors import fleet_slots
from tasks.app import app
from tasks.shared.config import gpu_queue, slot_own_queue
from tests.chaos.conftest import ARTIFACTS
from tests.factories import GpuClassFactory, ModelFactory
from tests.support.jobs import wait_for_job
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora
from tests.support.workers import WorkerProcess, database_url, start_worker, stop_workers, wait_until_consuming

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CLASS = "lora-routes"
QUEUE = gpu_queue(CLASS)
PARAMS = {"max_tokens": 4, "temperature": 0}


@pytest.fixture
def slots(pipeline_workers: dict[str, Any]) -> Iterator[dict[str, WorkerProcess]]:
    """Two slots of the class, with heartbeats and own queues as the launcher starts them."""
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict), "CUDA_VISIBLE_DEVICES": ""}
    workers = {}
    for n in range(2):
        name = f"lora-slot{n}"
        worker = f"{name}@test"
        own = slot_own_queue(QUEUE, worker)
        workers[worker] = start_worker(
            name,
            f"{QUEUE},{own}",
            env={
                **env,
                "BATCHERY_SLOT": str(n),
                "BATCHERY_GPU_CLASS": CLASS,
                "BATCHERY_QUEUE": QUEUE,
                "BATCHERY_WORKER_NAME": worker,
                "BATCHERY_OWN_QUEUE": own,
                "BATCHERY_TORCH_THREADS": "1",
            },
            log_dir=ARTIFACTS / "logs",
        )
    try:
        wait_until_consuming(list(workers.values()))
        yield workers
    finally:
        stop_workers(workers.values())
        with app.connection_for_write() as broker:
            for queue in [QUEUE, *(slot_own_queue(QUEUE, worker) for worker in workers)]:
                broker.SimpleQueue(queue).clear()


def _holders(fingerprint: str) -> set[str]:
    return {beat["worker"] for beat in fleet_slots() if fingerprint in beat.get("adapters", [])}


def _wait_for_beats(workers: set[str], predicate: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beats = [beat for beat in fleet_slots() if beat.get("worker") in workers]
        if predicate(beats):
            capacity._cached = None
            return beats
        time.sleep(0.5)
    raise AssertionError(f"the slots' heartbeats never showed it: {json.dumps(fleet_slots())[:2000]}")


def test_the_shards_of_a_job_naming_an_adapter_run_on_the_slot_that_holds_it(
    slots: dict[str, WorkerProcess], pipeline_workers: dict[str, Any], acme: Any, write_jsonl: Any, tmp_path: Path
) -> None:
    base = build_tiny_causal_lm(tmp_path / "tiny-base")
    model = ModelFactory(
        name="routes-base",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.GENERATE,
        source=str(base),
        default_params=PARAMS,
        gpu_class=GpuClassFactory(name=CLASS),
        is_default=False,
    )
    alpha = Adapter.objects.create(
        name="alpha",
        base_model=model,
        owner=acme,
        source=str(build_tiny_lora(base, tmp_path / "alpha", seed=1)),
        rank=4,
    )
    fingerprint = alpha.to_spec().fingerprint
    _wait_for_beats(set(slots), lambda beats: len(beats) == 2)

    def run(records: int, shard_size: int) -> Job:
        path = write_jsonl([{"custom_id": f"r{n}", "model": "alpha", "prompt": f"Line {n}"} for n in range(records)])
        job = job_submit(
            tenant=acme, request=JobRequest(model_name="routes-base", input_uri=str(path), shard_size=shard_size)
        )
        job = wait_for_job(job, workers={**pipeline_workers, **slots})
        assert job.status == JobStatus.SUCCEEDED, job.error
        return job

    first = run(2, 2)
    [holder] = {shard.worker for shard in first.shards.all()}
    _wait_for_beats(set(slots), lambda beats: _holders(fingerprint) == {holder})

    second = run(8, 4)

    # Both were sent to the holder's own queue, which no other slot consumes, though the other slot was idle.
    assert {shard.worker for shard in second.shards.all()} == {holder}
    assert {shard.slot_queue for shard in second.shards.all()} == {slot_own_queue(QUEUE, holder)}
    [other] = set(slots) - {holder}
    beats = _wait_for_beats({other}, lambda beats: len(beats) == 1)
    assert fingerprint not in beats[0]["adapters"], "the other slot never loaded the adapter"
