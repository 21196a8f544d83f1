"""A job as the API shows it: the serializer's direct path gives what DRF's generic path gives, field for field."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework import serializers
from rest_framework.test import APIRequestFactory

from portal.api.serializers import JobSerializer
from portal.jobs.models import Job, JobStatus
from tasks.shared.progress import Progress

pytestmark = pytest.mark.django_db


def _job(acme: Any, minilm: Any, **fields: Any) -> Job:
    return Job.objects.create(tenant=acme, model=minilm, input_uri="file:///in.jsonl", **fields)


def test_the_direct_path_equals_the_generic_path_for_jobs_in_every_state(acme: Any, minilm: Any) -> None:
    now = timezone.now()
    jobs = [
        _job(acme, minilm),
        _job(
            acme,
            minilm,
            status=JobStatus.RUNNING,
            params={"normalize": True, "nested": {"list": [1, 2.5, None]}},
            total_records=100,
            shard_count=4,
            started_at=now,
            deadline_at=now + timedelta(hours=1),
            priority=7,
        ),
        _job(
            acme,
            minilm,
            status=JobStatus.SUCCEEDED,
            total_records=10,
            succeeded_records=9,
            failed_records=1,
            shard_count=2,
            started_at=now,
            finished_at=now + timedelta(seconds=3, microseconds=12),
            output_uri="file:///out.jsonl",
            retry_round=1,
            input_format="csv",
            text_column="text",
            id_column="id",
            output_format="parquet",
        ),
        _job(acme, minilm, status=JobStatus.FAILED, error="line 3: not JSON", shard_count=0, finished_at=now),
    ]
    request = APIRequestFactory().get("/api/v1/jobs/", HTTP_HOST="testserver")
    live = {str(jobs[1].pk): Progress(done=40, failed=2)}

    for context in ({"request": request, "live_progress": live}, {}):
        for job in Job.objects.select_related("model").filter(pk__in=[job.pk for job in jobs]):
            serializer = JobSerializer(job, context=context)
            generic = serializers.ModelSerializer.to_representation(serializer, job)

            assert serializer.data == generic
            assert list(serializer.data) == list(generic) == JobSerializer.Meta.fields


def test_links_name_each_jobs_own_id_on_a_page(acme: Any, minilm: Any) -> None:
    ended = [
        _job(acme, minilm, status=JobStatus.SUCCEEDED, shard_count=1, finished_at=timezone.now()) for _ in range(3)
    ]
    request = APIRequestFactory().get("/api/v1/jobs/", HTTP_HOST="testserver")

    data = JobSerializer(ended, many=True, context={"request": request}).data

    assert [row["output_url"] for row in data] == [f"http://testserver/api/v1/jobs/{job.pk}/output/" for job in ended]
    assert [row["errors_url"] for row in data] == [f"http://testserver/api/v1/jobs/{job.pk}/errors/" for job in ended]
