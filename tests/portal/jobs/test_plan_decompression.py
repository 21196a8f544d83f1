"""The planner reads a compressed input no further than the decompression limits: a bomb too large to
check at submission fails its job naming the limit, with its shard inputs deleted and no more than
about the limit written to storage."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest

from portal.execution.plan import job_plan
from portal.jobs.models import JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services import submit
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Quota, Tenant
from tasks.shared.storage import store_for
from tests.support.bombs import LINE, MiB, written_bytes, zstd_bomb


def _planned(acme: Tenant, path: Path, settings: Any, django_capture_on_commit_callbacks: Any) -> Any:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0  # as for an input too large to check at submission
    job = job_submit(
        tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=500)
    )
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    return job


def test_the_planner_fails_a_job_whose_input_decompresses_past_the_limit(
    acme: Tenant,
    minilm: Any,
    tmp_path: Path,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_DECOMPRESSED_BYTES", str(8 * MiB))
    path = tmp_path / "bomb.jsonl.zst"
    path.write_bytes(zstd_bomb())
    written = written_bytes()
    job = _planned(acme, path, settings, django_capture_on_commit_callbacks)
    assert written_bytes() - written <= 10 * MiB  # the 8 MiB of shard inputs, at most, and the rest
    assert job.status == JobStatus.FAILED
    assert job.error == (
        f"input rejected: the input decompresses to more than {8 * MiB} bytes, "
        "the limit BATCHERY_MAX_DECOMPRESSED_BYTES sets"
    )
    shards = list(job.shards.all())
    assert shards and not any(store_for(shard.input_uri).exists(shard.input_uri) for shard in shards)


def test_the_planner_holds_a_compressed_input_to_the_tenants_input_bytes_quota(
    acme: Tenant, minilm: Any, tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    Quota.objects.filter(tenant=acme).update(max_input_bytes=4 * MiB)
    path = tmp_path / "bomb.jsonl.zst"
    path.write_bytes(zstd_bomb(total=32 * MiB))
    job = _planned(acme, path, settings, django_capture_on_commit_callbacks)
    assert job.status == JobStatus.FAILED
    assert f"more than {4 * MiB} bytes, the limit quota max_input_bytes sets" in job.error


def test_a_small_compressed_input_that_expands_far_is_left_to_its_planner(
    acme: Tenant,
    minilm: Any,
    tmp_path: Path,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    # Small enough to check at submission by its size, but past what the request reads when expanded.
    monkeypatch.setattr(submit, "SUBMIT_CHECK_DECOMPRESSED_BYTES", MiB)
    path = tmp_path / "input.jsonl.gz"
    path.write_bytes(gzip.compress(LINE * 1000))  # 4 MiB expanded, a few KB compressed
    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path)))
    assert job.total_records is None  # not counted at submission
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert (job.status, job.total_records) == (JobStatus.RUNNING, 1000)
