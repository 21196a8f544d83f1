"""Jobs on S3: moto's server as its own process, reached over HTTP by the API, the planner, the
shards and the merge; outputs fetched through presigned URLs; an outage in the middle survived."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from typing import Any

import boto3
import pytest
from rest_framework.test import APIClient

from portal.catalog.models import Model
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.tenancy.apikeys import apikey_create
from tests.conftest import S3Service
from tests.factories import MembershipFactory, ModelFactory, UserFactory
from tests.support.jobs import wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def _bucket(s3: S3Service) -> tuple[Any, str]:
    admin = boto3.client("s3", endpoint_url=s3.server_url)
    name = f"batchery-{uuid.uuid4().hex[:10]}"
    admin.create_bucket(Bucket=name)
    return admin, name


def _client(tenant: Any) -> APIClient:
    user = UserFactory()
    MembershipFactory(user=user, tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {apikey_create(tenant=tenant, user=user)[1]}")
    return client


def _put_jsonl(admin: Any, bucket: str, key: str, records: list[dict[str, Any]]) -> str:
    body = "".join(json.dumps(record) + "\n" for record in records).encode()
    admin.put_object(Bucket=bucket, Key=key, Body=body)
    return f"s3://{bucket}/{key}"


def test_a_job_reads_s3_input_writes_s3_output_and_the_output_comes_through_a_presigned_url(
    pipeline_workers: dict[str, Any], s3: S3Service, acme: Any, minilm: Any, settings: Any
) -> None:
    admin, bucket = _bucket(s3)
    settings.BATCHERY_STORAGE_URL = f"s3://{bucket}/batchery"
    texts = [f"sentence {n} about storage" for n in range(40)]
    input_uri = _put_jsonl(
        admin, bucket, "datasets/acme/in.jsonl", [{"custom_id": f"s{n}", "input": t} for n, t in enumerate(texts)]
    )
    acme.storage_prefixes = [f"s3://{bucket}/datasets/acme/"]
    acme.save()
    client = _client(acme)

    created = client.post(
        "/api/v1/jobs/", {"model": minilm.name, "input_uri": input_uri, "shard_size": 15}, format="json"
    )
    assert created.status_code == 201, created.json()
    job = wait_for_job(Job.objects.get(pk=created.json()["id"]), workers=pipeline_workers)

    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.output_uri.startswith(f"s3://{bucket}/batchery/jobs/")
    assert all(shard.input_uri.startswith("s3://") for shard in job.shards.all())
    urls = client.get(f"/api/v1/jobs/{job.pk}/download-urls/").json()
    assert urls["presigned"] is True and "X-Amz-Signature=" in urls["output"]
    with urllib.request.urlopen(urls["output"], timeout=10) as response:
        lines = [json.loads(line) for line in response.read().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"s{n}" for n in range(40)]
    assert all(len(line["response"]["embedding"]) == 384 for line in lines)


def test_a_storage_outage_during_a_shard_is_retried_and_the_job_completes(
    pipeline_workers: dict[str, Any], s3: S3Service, acme: Any, settings: Any
) -> None:
    admin, bucket = _bucket(s3)
    settings.BATCHERY_STORAGE_URL = f"s3://{bucket}/batchery"
    ModelFactory(
        name="slow-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.CLASSIFY,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": 0.2, "batch_size": 4},
        is_default=False,
    )
    input_uri = _put_jsonl(admin, bucket, "in.jsonl", [{"custom_id": f"r{n}", "input": f"t{n}"} for n in range(20)])
    from portal.jobs.services.submit import job_submit

    job = job_submit(tenant=acme, request=JobRequest(model_name="slow-echo", input_uri=input_uri, shard_size=20))

    # Once the shard has started (its attempt marker is in the bucket), cut the network to S3 for
    # longer than the shard computes, so its output upload meets the outage.
    deadline = time.monotonic() + 120
    while not any("/started/" in item["Key"] for item in admin.list_objects_v2(Bucket=bucket).get("Contents", [])):
        assert time.monotonic() < deadline, "the shard never started"
        time.sleep(0.1)
    s3.proxy.down()
    refused_before = s3.proxy.refused
    threading.Timer(8.0, s3.proxy.up).start()
    job = wait_for_job(job, workers=pipeline_workers)

    assert s3.proxy.refused > refused_before, "no request met the outage"
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.succeeded_records == 20
