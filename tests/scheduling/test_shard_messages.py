"""A shard's message as a worker takes it from the broker: its whole spec in its arguments, and printed
arguments (logs, Flower) that name the shard without printing the spec, for it and for its callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.jobs.services.scheduler import schedule_queue
from tasks.app import app
from tasks.config import gpu_queue
from tasks.logging_setup import received_log_fields
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _pending_shard(gpu_class: Any, root: Path) -> Shard:
    job = Job.objects.create(
        tenant=TenantFactory(name="messages"),
        model=ModelFactory(name="messages", gpu_class=gpu_class, is_default=False),
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        shard_size=3,
        total_records=3,
        started_at=timezone.now(),
    )
    return Shard.objects.create(
        job=job,
        index=0,
        first_record=0,
        record_count=3,
        input_uri=(root / "0.jsonl").as_uri(),
        prefix_uri=(root / "shard-0").as_uri(),
        status=ShardStatus.PENDING,
    )


def test_a_shards_message_prints_the_fields_that_name_it_and_carries_its_whole_spec(
    gpu_class: Any, tmp_path: Path
) -> None:
    shard = _pending_shard(gpu_class, tmp_path)
    job_id = str(shard.job_id)
    queue = gpu_queue(gpu_class.name)
    assert schedule_queue(queue) == 1

    with app.connection_for_read() as connection:
        message = connection.SimpleQueue(queue).get(timeout=5)
        message.ack()
    headers = message.headers
    [spec], _, embed = message.decode()

    assert headers["task"] == "batchery.run_shard"
    assert headers["argsrepr"] == f"({{'job_id': '{job_id}', 'shard_index': 0, 'record_count': 3}},)"
    assert headers["kwargsrepr"] == "{}"
    # What the worker's "received" log line is read for (`tasks.logging_setup`).
    assert received_log_fields("batchery.run_shard", headers["argsrepr"], "{}") == {"job_id": job_id, "shard": 0}
    assert spec["input_uri"] == shard.input_uri and spec["model"]["name"] == "messages"

    callback = embed["chord"]
    [on_error] = callback["options"]["link_error"]
    for signature in (callback, on_error):
        assert signature["task"] == "batchery.shard_done"
        assert signature["args"] == [job_id, 0, queue]
        assert signature["options"]["argsrepr"] == repr((job_id, 0, queue))
        assert signature["options"]["kwargsrepr"] == "{}"
