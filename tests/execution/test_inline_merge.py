"""A small job merges in the callback that settled its last shard; a larger one, or one whose merge
fails there, gets the merge task. Real PostgreSQL, Redis and files; no worker runs here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.reconcile import write_commit
from portal.execution import endings
from portal.execution.endings import ShardEnding, endings_settle
from portal.execution.scheduler import schedule_queue
from portal.jobs.models import Job, JobStatus, Shard
from tasks.shared.config import gpu_queue
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)

RECORDS = 3


@pytest.fixture
def merges_sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The jobs whose merge went to the merge task (none runs here)."""
    sent: list[str] = []
    monkeypatch.setattr(endings, "_send_merge", sent.append)
    return sent


def _finished_one_shard_job(root: Path, gpu_class: Any) -> tuple[Job, bytes]:
    """A planned one-shard job whose shard ran and committed its output; its callback has not come yet."""
    model = ModelFactory(name="inline-merge-model", gpu_class=gpu_class, is_default=False)
    job = Job.objects.create(
        tenant=TenantFactory(name="solo"),
        model=model,
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        errors_uri=(root / "errors.jsonl").as_uri(),
        shard_size=RECORDS,
        shard_count=1,
        total_records=RECORDS,
    )
    prefix = root / str(job.pk) / "shard-0"
    prefix.mkdir(parents=True)
    output = b"".join(
        orjson.dumps({"custom_id": f"r{i}", "response": {"label": "x"}}, option=orjson.OPT_APPEND_NEWLINE)
        for i in range(RECORDS)
    )
    (prefix / "out.jsonl").write_bytes(output)
    (prefix / "errors.jsonl").write_bytes(b"")
    Shard.objects.create(
        job=job,
        index=0,
        first_record=0,
        record_count=RECORDS,
        input_uri=(prefix / "input.jsonl").as_uri(),
        prefix_uri=prefix.as_uri(),
        estimated_seconds=1.0,
    )
    schedule_queue(gpu_queue(gpu_class.name))
    write_commit(job.shards.get(), compute_seconds=0.1)
    return job, output


def test_a_small_job_ends_in_the_callback_that_settled_its_last_shard(
    gpu_class: Any, tmp_path: Path, merges_sent: list[str]
) -> None:
    job, output = _finished_one_shard_job(tmp_path, gpu_class)

    endings_settle([ShardEnding(str(job.pk), 0)])

    job.refresh_from_db()
    assert (job.status, job.succeeded_records, job.failed_records) == (JobStatus.SUCCEEDED, RECORDS, 0)
    assert (tmp_path / "output.jsonl").read_bytes() == output
    assert merges_sent == [], "no merge task: the callback merged"


def test_a_job_above_the_limit_gets_the_merge_task(
    gpu_class: Any, tmp_path: Path, merges_sent: list[str], settings: Any
) -> None:
    settings.BATCHERY_INLINE_MERGE_MAX_RECORDS = RECORDS - 1
    job, _ = _finished_one_shard_job(tmp_path, gpu_class)

    endings_settle([ShardEnding(str(job.pk), 0)])

    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING
    assert not (tmp_path / "output.jsonl").exists()
    assert merges_sent == [str(job.pk)]


def test_a_merge_that_fails_in_the_callback_is_handed_to_the_merge_task(
    gpu_class: Any, tmp_path: Path, merges_sent: list[str]
) -> None:
    job, _ = _finished_one_shard_job(tmp_path, gpu_class)
    (tmp_path / str(job.pk) / "shard-0" / "out.jsonl").unlink()  # its store fails mid-merge

    endings_settle([ShardEnding(str(job.pk), 0)])

    job.refresh_from_db()
    assert job.status == JobStatus.MERGING, "left for the merge task to resume, not failed"
    assert not (tmp_path / "output.jsonl").exists()
    assert merges_sent == [str(job.pk)]
