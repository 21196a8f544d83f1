"""POST /api/v1/jobs/{id}/rerun/ and GET /api/v1/jobs/{id}/comparison/: a member re-runs a job with changes,
a refusal names the field, another tenant's job is a 404, and the comparison is a 409 until both jobs have
ended, a 202 while the comparison task writes a large re-run's, and a 404 for a job that is no re-run.
(The report's figures: tests/portal/jobs/test_rerun_comparison.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import Model
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Membership
from tasks import send
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db


@pytest.fixture
def job(settings: Any, tmp_path: Path, minilm: Model, caller: Callable[..., Caller]) -> Job:
    settings.BATCHERY_INPUT_ROOTS = [tmp_path.as_uri()]
    member = caller("acme")
    path = tmp_path / "input.jsonl"
    path.write_text('{"input": "a"}\n{"input": "b"}\n')
    return job_submit(
        tenant=member.tenant,
        user=member.user,
        request=JobRequest(model_name=minilm.name, input_uri=str(path), params={"normalize": True, "batch_size": 8}),
    )


def test_a_member_reruns_a_job_with_params_merged_and_the_new_job_names_the_old(
    job: Job, caller: Callable[..., Caller]
) -> None:
    member = caller(job.tenant, username="bob")
    answer = member.client.post(
        f"/api/v1/jobs/{job.pk}/rerun/", {"params": {"batch_size": 4, "normalize": None}}, format="json"
    )
    assert answer.status_code == 201, answer.content
    rerun = Job.objects.get(pk=answer.json()["id"])
    assert str(rerun.rerun_of_id) == str(job.pk) == answer.json()["rerun_of"]
    assert rerun.params["batch_size"] == 4 and "normalize" not in rerun.params
    assert rerun.input_uri == job.input_uri

    waiting = member.client.get(f"/api/v1/jobs/{rerun.pk}/comparison/")
    assert waiting.status_code == 409, waiting.content
    assert "queued" in waiting.json()["error"]["message"]
    assert member.client.get(f"/api/v1/jobs/{job.pk}/comparison/").status_code == 404, "no re-run"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"params": [1, 2]}, "params"),
        ({"model": "no-such-model"}, "model"),
        ({"model_version": "x" * 51}, "model_version"),
        ({"params": {"temperature": 0.5}}, "params"),
    ],
)
def test_a_refused_rerun_names_the_field(
    job: Job, caller: Callable[..., Caller], body: dict[str, Any], field: str
) -> None:
    answer = caller(job.tenant, username="bob").client.post(f"/api/v1/jobs/{job.pk}/rerun/", body, format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.json()["error"]["fields"], answer.json()
    assert Job.objects.count() == 1


def test_another_tenants_job_is_a_404_and_a_viewer_may_not_rerun(job: Job, caller: Callable[..., Caller]) -> None:
    stranger = caller("globex")
    assert stranger.client.post(f"/api/v1/jobs/{job.pk}/rerun/", {}, format="json").status_code == 404
    assert stranger.client.get(f"/api/v1/jobs/{job.pk}/comparison/").status_code == 404
    viewer = caller(job.tenant, role=Membership.Role.VIEWER, username="val")
    assert viewer.client.post(f"/api/v1/jobs/{job.pk}/rerun/", {}, format="json").status_code == 403


def test_a_large_reruns_comparison_not_yet_written_is_a_202_that_asks_the_comparison_task(
    job: Job, caller: Callable[..., Caller], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    member = caller(job.tenant, username="bob")
    rerun = Job.objects.get(pk=member.client.post(f"/api/v1/jobs/{job.pk}/rerun/", {}, format="json").json()["id"])
    Job.objects.filter(pk__in=[job.pk, rerun.pk]).update(status=JobStatus.SUCCEEDED)
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 1
    sent: list[str] = []
    monkeypatch.setattr(send, "send_comparison", sent.append)

    answer = member.client.get(f"/api/v1/jobs/{rerun.pk}/comparison/")

    assert answer.status_code == 202, answer.content
    assert answer["Retry-After"] == "30"
    assert answer.json()["status"] == "computing"
    assert "2 records" in answer.json()["detail"]
    assert sent == [str(rerun.pk)]
