"""An input too large to check at submission is checked by its planner: a chat record whose media the model does
not take, or that a slot would fetch, fails the job naming the line and the part, before any shard is sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import Model
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db


def _planned(path: Path, records: list[dict[str, Any]], captured: Any) -> Job:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    job = job_submit(tenant=TenantFactory(name="acme"), request=JobRequest(model_name="plan-chat", input_uri=str(path)))
    with captured():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    return job


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://169.254.169.254/latest/meta-data/", "line 2: messages[0].content[0].image_url.url is 'http://169."),
        ("data:image/png;base64,AAAA", "line 2: messages[0].content[0] is image input ('image_url'), which this model"),
    ],
)
def test_the_planner_fails_the_job_naming_the_line_and_part(
    tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any, url: str, expected: str
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    ModelFactory(name="plan-chat", engine=Model.Engine.VLLM, task=Model.Task.CHAT, source="/x", is_default=False)
    image = {"type": "image_url", "image_url": {"url": url}}
    records = [
        {"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]},
        {"custom_id": "b", "messages": [{"role": "user", "content": [image]}]},
    ]

    job = _planned(tmp_path / "in.jsonl", records, django_capture_on_commit_callbacks)

    assert job.status == JobStatus.FAILED
    assert expected in job.error
    assert not Shard.objects.filter(job=job).exists()
