"""A prefix-grouped job publishes what the same job planned ungrouped publishes, byte for byte: its
shards run through the slot's shard body (`execute_shard`) on a model that fails some records, and
the merge puts their lines, error lines and a retry round's in input order. Real PostgreSQL, Redis
and files; no worker runs here."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from portal.catalog.models import Model
from portal.execution.dispatch import shard_spec
from portal.execution.merge import job_merge
from portal.execution.merge_order import shard_positions
from portal.execution.plan import job_plan
from portal.execution.settle import shard_record_success
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.partial import job_partial_output
from portal.jobs.services.retry import job_retry
from portal.jobs.services.submit import job_submit
from portal.jobs.storage_layout import job_root, parquet_output_uri
from tasks.shared.specs import ShardManifest
from tasks.shared.storage import store_for
from tasks.slot.shard_execution import execute_shard
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db

LINES = 600
VARIANTS = 6
FLAKY_EVERY = 13
"""Every 13th record fails (`flaky_factory`) until its fault is fixed."""


def prompt(n: int) -> str:
    rng = random.Random(n % VARIANTS)
    system = f"Instructions {n % VARIANTS}: " + "".join(rng.choice("abcdefgh ") for _ in range(300))
    return f"{system}\nQuestion {n}{' FLAKY' if n % FLAKY_EVERY == 0 else ''}"


@pytest.fixture
def grouping(settings: Any, tmp_path: Path) -> Path:
    """Groups by the first 100 characters (the instructions); returns the file that fixes the fault."""
    settings.BATCHERY_PREFIX_GROUP_CHARS = 100
    settings.BATCHERY_PREFIX_GROUP_MIN_RECORDS = 20
    fixed = tmp_path / "fixed"
    ModelFactory(
        name="group-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.GENERATE,
        source="tests.support.chaos_engines:flaky_factory",
        default_params={"fixed_when_exists": str(fixed)},
        is_default=False,
    )
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"prompt": prompt(n)}) + b"\n" for n in range(LINES)))
    return fixed


def planned(tmp_path: Path, captured: Any, **request: Any) -> Job:
    tenant = TenantFactory()
    job = job_submit(
        tenant=tenant,
        request=JobRequest(
            model_name="group-echo", input_uri=str(tmp_path / "prompts.jsonl"), shard_size=45, **request
        ),
    )
    with captured():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING, job.error
    return job


def run_shards(job: Job, *, only: Any = lambda index: True) -> None:
    """Run the round's shards through the slot's shard body and record their commits, as settling does."""
    for shard in job.shards.filter(round=job.retry_round).order_by("index"):
        if only(shard.index):
            manifest = execute_shard(shard_spec(job, shard), worker="w1")
            assert isinstance(manifest, ShardManifest)
            shard_record_success(shard, manifest)


def merged(job: Job, captured: Any, *, stop: str | None = None) -> Job:
    with captured():
        job_merge(job_id=str(job.id), stop=stop)
    job.refresh_from_db()
    return job


def read(uri: str) -> bytes:
    return store_for(uri).read_bytes(uri)


def test_a_grouped_job_publishes_the_bytes_of_the_same_job_ungrouped_and_so_does_its_retry(
    grouping: Path, tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    grouped = planned(tmp_path, django_capture_on_commit_callbacks)
    settings.BATCHERY_PREFIX_GROUPING = False
    plain = planned(tmp_path, django_capture_on_commit_callbacks)
    assert (grouped.prefix_groups, plain.prefix_groups) == (VARIANTS, 0)
    assert grouped.shards.exclude(first_record__in=[0, 1, 2, 3, 4, 5]).exists(), "shards of interleaved records"

    for job in (grouped, plain):
        run_shards(job)
        merged(job, django_capture_on_commit_callbacks)
        assert job.status == JobStatus.PARTIALLY_SUCCEEDED, job.error
    lines = [orjson.loads(line) for line in read(grouped.output_uri).splitlines()]
    assert [line["custom_id"] for line in lines] == [str(n) for n in range(1, LINES + 1)], "ids are line numbers"
    assert [line["response"]["echo"] if "response" in line else None for line in lines] == [
        None if n % FLAKY_EVERY == 0 else prompt(n) for n in range(LINES)
    ]
    assert read(grouped.output_uri) == read(plain.output_uri)
    assert read(grouped.errors_uri) == read(plain.errors_uri)
    assert read(grouped.errors_uri).count(b"\n") == len(range(0, LINES, FLAKY_EVERY))
    assert (grouped.succeeded_records, grouped.failed_records) == (plain.succeeded_records, plain.failed_records)

    grouping.touch()  # the fault is fixed: a retry round runs the failed records again
    for job in (grouped, plain):
        job_retry(job=job)
        with django_capture_on_commit_callbacks():
            job_plan(job_id=str(job.pk))  # the planning lane cuts the round
        job.refresh_from_db()
        run_shards(job)
        job = merged(job, django_capture_on_commit_callbacks)
        assert job.status == JobStatus.SUCCEEDED, job.error
    assert read(grouped.output_uri) == read(plain.output_uri)
    assert [orjson.loads(line)["response"]["echo"] for line in read(grouped.output_uri).splitlines()] == [
        prompt(n) for n in range(LINES)
    ]


def test_an_expired_grouped_job_turns_its_unfinished_records_into_error_lines_in_input_order(
    grouping: Path, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    job = planned(tmp_path, django_capture_on_commit_callbacks)
    run_shards(job, only=lambda index: index % 2 == 0)
    ran = {position for shard in job.shards.all() if shard.index % 2 == 0 for position in shard_positions(shard)}

    job = merged(job, django_capture_on_commit_callbacks, stop="expired")

    assert job.status == JobStatus.EXPIRED
    lines = [orjson.loads(line) for line in read(job.output_uri).splitlines()]
    assert len(lines) == LINES
    for n, line in enumerate(lines):
        if n not in ran:
            assert line["error"]["code"] == "expired", n
        elif n % FLAKY_EVERY:
            assert line["response"]["echo"] == prompt(n)
    errors = [line for line in lines if "error" in line]
    assert read(job.errors_uri) == b"".join(orjson.dumps(line) + b"\n" for line in errors)


def test_a_grouped_jobs_partial_download_is_a_prefix_of_its_output(
    grouping: Path, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    job = planned(tmp_path, django_capture_on_commit_callbacks)
    last = job.shards.order_by("-first_record").first()
    assert last is not None
    run_shards(job, only=lambda index: index != last.index)

    partial = job_partial_output(job)
    prefix = b"".join(partial.chunks())

    assert partial.records == last.first_record > 0
    assert prefix.count(b"\n") == partial.records
    run_shards(job, only=lambda index: index == last.index)
    job = merged(job, django_capture_on_commit_callbacks)
    assert read(job.output_uri).startswith(prefix)


def test_a_grouped_parquet_output_is_the_ungrouped_ones_bytes(
    grouping: Path, tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    grouped = planned(tmp_path, django_capture_on_commit_callbacks, output_format="parquet")
    settings.BATCHERY_PREFIX_GROUPING = False
    plain = planned(tmp_path, django_capture_on_commit_callbacks, output_format="parquet")

    outputs = []
    for job in (grouped, plain):
        run_shards(job)
        merged(job, django_capture_on_commit_callbacks)
        outputs.append(read(parquet_output_uri(job_root(job))))
    assert outputs[0] == outputs[1]
    table = pq.read_table(pa.BufferReader(outputs[0]))
    assert table.column("custom_id").to_pylist() == [str(n) for n in range(1, LINES + 1)]
