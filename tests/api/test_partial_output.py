"""Partial results: while a job runs, `?partial=true` streams the committed prefix of its shards, a
prefix of the final output that each later download extends; the portal and the batch object link it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from django.test import Client

from portal.execution.merge import job_merge, job_merge_advance
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.services.partial import job_partial_output
from portal.openai_api.models import Batch, File
from portal.tenancy.models import Tenant
from tests.api.conftest import Caller
from tests.support.jobs import CommittedLayout, committed_job, committed_settle

pytestmark = pytest.mark.django_db(transaction=True)

SHARDS = 20
RECORDS = 5
FAILED_SHARD = 7
"""This shard fails for good: the final output holds a `shard_failed` error line for each of its records."""
LAYOUT = CommittedLayout(shards=SHARDS, records=RECORDS, failed_shard=FAILED_SHARD, seed=15)


def _running_job(root: Path, tenant: Tenant, *, output_format: str = "jsonl") -> Job:
    """A running 20-shard job whose workers have all committed (one shard failed), none yet settled."""
    return committed_job(root, LAYOUT, tenant=tenant, output_format=output_format)


def _settle(shard: Shard) -> None:
    """What settling records for the shard as its task ends, and the merge's stitching ahead after it."""
    committed_settle(shard, LAYOUT)
    job_merge_advance(job_id=str(shard.job_id))


def _partial(client: Any, job: Job) -> Any:
    response = client.get(f"/api/v1/jobs/{job.pk}/output/?partial=true")
    assert response.status_code == 200, response.content
    return response


def _body(response: Any) -> bytes:
    return b"".join(response.streaming_content)


def _committed_prefix(settled: set[int]) -> int:
    """Shards from index 0 up to the first one not settled."""
    count = 0
    while count in settled:
        count += 1
    return count


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_each_partial_download_holds_the_committed_prefix_and_extends_the_one_before(
    caller: Callable[..., Caller], tmp_path: Path, output_format: str
) -> None:
    acme = caller("acme")
    job = _running_job(tmp_path, acme.tenant, output_format=output_format)
    shards = list(job.shards.order_by("index"))
    order = list(range(SHARDS))
    random.Random(4).shuffle(order)

    response = _partial(acme.client, job)
    assert _body(response) == b"" and response["X-Batchery-Partial-Shards"] == "0"
    downloads: list[tuple[int, bytes]] = []
    settled: set[int] = set()
    for index in order:
        _settle(shards[index])
        settled.add(index)
        response = _partial(acme.client, job)
        body = _body(response)
        prefix = _committed_prefix(settled)
        assert response["X-Batchery-Partial-Shards"] == str(prefix)
        assert response["X-Batchery-Partial-Records"] == str(prefix * RECORDS)
        assert response["X-Batchery-Partial-Complete"] == "false"
        # JSONL whatever the output format: a Parquet file is whole only with its footer.
        assert response["Content-Type"] == "application/jsonl"
        assert response["Content-Disposition"] == f'attachment; filename="{job.pk}-output.partial.jsonl"'
        ids = [orjson.loads(line)["custom_id"] for line in body.splitlines()]
        assert ids == [f"r{n}" for n in range(prefix * RECORDS)], f"exactly the records of shards 0..{prefix - 1}"
        assert body.startswith(downloads[-1][1] if downloads else b""), "each download extends the one before"
        downloads.append((prefix, body))
    assert {prefix for prefix, _ in downloads} >= {0, SHARDS}, "the shuffle left a gap open for a while"

    job_merge(job_id=str(job.pk))
    job.refresh_from_db()
    assert job.status == JobStatus.PARTIALLY_SUCCEEDED
    final = (tmp_path / "output.jsonl").read_bytes()
    for prefix, body in downloads:
        assert final[: len(body)] == body, f"the download of {prefix} shards is the final output's first bytes"
    failed = [orjson.loads(line) for line in final.splitlines()][FAILED_SHARD * RECORDS : (FAILED_SHARD + 1) * RECORDS]
    assert {line["error"]["code"] for line in failed} == {"shard_failed"}, "the failed shard's lines, as merged"

    response = _partial(acme.client, job)
    assert _body(response) == final, "an ended job's partial download is its final output (JSONL)"
    assert response["X-Batchery-Partial-Complete"] == "true"
    assert response["X-Batchery-Partial-Records"] == str(SHARDS * RECORDS)


def test_a_bad_partial_value_answers_400_naming_the_parameter(caller: Callable[..., Caller], tmp_path: Path) -> None:
    acme = caller("acme")
    job = _running_job(tmp_path, acme.tenant)

    response = acme.client.get(f"/api/v1/jobs/{job.pk}/output/?partial=maybe")

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "partial"
    off = acme.client.get(f"/api/v1/jobs/{job.pk}/output/?partial=false")
    assert off.status_code == 409, "without `partial`, the output exists once the job has ended, as before"


def test_another_tenants_partial_output_answers_404(caller: Callable[..., Caller], tmp_path: Path) -> None:
    acme, globex = caller("acme"), caller("globex")
    job = _running_job(tmp_path, acme.tenant)
    _settle(job.shards.get(index=0))

    assert globex.client.get(f"/api/v1/jobs/{job.pk}/output/?partial=true").status_code == 404
    portal = Client()
    portal.force_login(globex.user)
    assert portal.get(f"/jobs/{job.pk}/output/partial/").status_code == 404


def test_the_job_page_offers_the_partial_download_while_the_job_runs(
    caller: Callable[..., Caller], tmp_path: Path
) -> None:
    acme = caller("acme")
    job = _running_job(tmp_path, acme.tenant)
    for index in (0, 1, 3):
        _settle(job.shards.get(index=index))
    portal = Client()
    portal.force_login(acme.user)

    page = portal.get(f"/jobs/{job.pk}/").content.decode()
    assert f'href="/jobs/{job.pk}/output/partial/"' in page and 'id="download-partial"' in page
    response = portal.get(f"/jobs/{job.pk}/output/partial/")
    assert response.status_code == 200 and response["X-Batchery-Partial-Shards"] == "2"
    assert _body(response) == _body(_partial(acme.client, job)), "the same bytes as the API's"

    for shard in job.shards.exclude(index__in=(0, 1, 3)):
        _settle(shard)
    job_merge(job_id=str(job.pk))
    page = portal.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="download-partial"' not in page and 'id="download-output"' in page, "once ended: the output"


def test_the_official_client_reads_the_batch_objects_partial_output_url(
    live_server: Any, caller: Callable[..., Caller], tmp_path: Path
) -> None:
    acme = caller("acme")
    job = _running_job(tmp_path, acme.tenant)
    for index in (0, 1):
        _settle(job.shards.get(index=index))
    file = File.objects.create(
        id="file-partial", tenant=acme.tenant, purpose="batch", filename="in.jsonl", bytes=1, uri="file:///x"
    )
    batch = Batch.objects.create(
        id="batch_partial",
        tenant=acme.tenant,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id=file.id,
        job=job,
    )
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=acme.key, max_retries=0, timeout=30)

    running = client.batches.retrieve(batch.id)

    assert running.status == "in_progress"
    url = (running.model_extra or {})["partial_output_url"]
    assert url == f"{live_server.url}/api/v1/jobs/{job.pk}/output/?partial=true"
    assert [(listed.model_extra or {})["partial_output_url"] for listed in client.batches.list()] == [url]
    download = httpx.get(url, headers={"Authorization": f"Bearer {acme.key}"})
    assert download.status_code == 200 and download.headers["X-Batchery-Partial-Records"] == str(2 * RECORDS)
    assert [orjson.loads(line)["custom_id"] for line in download.content.splitlines()] == [
        f"r{n}" for n in range(2 * RECORDS)
    ]

    Job.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED)
    assert (client.batches.retrieve(batch.id).model_extra or {})["partial_output_url"] is None


def test_a_retry_round_streams_the_output_the_earlier_round_published(
    caller: Callable[..., Caller], tmp_path: Path
) -> None:
    acme = caller("acme")
    job = _running_job(tmp_path, acme.tenant)
    for shard in job.shards.all():
        _settle(shard)
    job_merge(job_id=str(job.pk))
    published = (tmp_path / "output.jsonl").read_bytes()
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, retry_round=1, finished_at=None)
    job.refresh_from_db()

    partial = job_partial_output(job)

    assert (partial.shards, partial.records, partial.complete) == (SHARDS, SHARDS * RECORDS, False)
    assert b"".join(partial.chunks()) == published


def test_a_cancelling_job_ends_the_prefix_at_a_failed_shard(caller: Callable[..., Caller], tmp_path: Path) -> None:
    acme = caller("acme")
    job = _running_job(tmp_path, acme.tenant)
    for shard in job.shards.filter(index__lte=FAILED_SHARD + 1):
        _settle(shard)
    assert job_partial_output(job).shards == FAILED_SHARD + 2, "running: the failed shard's error lines count"

    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLING)
    job.refresh_from_db()

    # The cancel's merge writes that shard's records as `cancelled` errors instead.
    assert job_partial_output(job).shards == FAILED_SHARD
