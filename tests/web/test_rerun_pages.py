"""The portal's re-run: the job page's form (a refusal named on the page) and the comparison page with its
histogram, drawn server-side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Membership, Tenant
from tasks import send
from tests.web.rerun_fixtures import rerun_pair

pytestmark = pytest.mark.django_db


def _client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_comparison_page_shows_the_figures_and_a_bar_a_bin(
    person: Callable[..., User], acme: Tenant, tmp_path: Path
) -> None:
    old, new = rerun_pair(acme, tmp_path)
    client = _client(person("alice", acme))

    page = client.get(f"/jobs/{new.pk}/comparison/")

    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="comparison-histogram"' in body
    assert body.count("data-count=") == 10, "ten bins of edit distance"
    assert "Exact match: 50 %" in body, "3 of 6 texts are the same"
    assert (tmp_path / "new" / "comparison.json").exists()
    assert client.get(f"/jobs/{old.pk}/comparison/").status_code == 404, "the old job is no re-run"
    assert 'id="comparison-link"' in client.get(f"/jobs/{new.pk}/").content.decode()


def test_a_large_reruns_comparison_page_says_it_is_being_written_while_the_task_writes_it(
    person: Callable[..., User], acme: Tenant, tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, new = rerun_pair(acme, tmp_path)
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 5
    monkeypatch.setattr(send, "send_comparison", lambda job_id: None)

    page = _client(person("alice", acme)).get(f"/jobs/{new.pk}/comparison/")

    assert page.status_code == 202
    assert "Being written" in page.content.decode()
    assert not (tmp_path / "new" / "comparison.json").exists()


def test_a_refused_rerun_is_named_on_the_job_page_and_a_viewer_sees_no_form(
    person: Callable[..., User], acme: Tenant, tmp_path: Path
) -> None:
    old, _ = rerun_pair(acme, tmp_path)
    member = _client(person("alice", acme))
    answer = member.post(f"/jobs/{old.pk}/rerun/", {"params": "[1]"}, follow=True)
    assert "Re-run refused (params): params must be a JSON object" in answer.content.decode()
    assert Job.objects.count() == 2
    viewer = _client(person("val", acme, role=Membership.Role.VIEWER))
    assert 'id="rerun-form"' not in viewer.get(f"/jobs/{old.pk}/").content.decode()
    assert viewer.post(f"/jobs/{old.pk}/rerun/", {}).status_code == 403


def test_a_member_reruns_a_job_from_its_page_and_lands_on_the_new_job(
    person: Callable[..., User], acme: Tenant, minilm: Any, tmp_path: Path, settings: Any
) -> None:
    settings.BATCHERY_INPUT_ROOTS = [tmp_path.as_uri()]
    path = tmp_path / "input.jsonl"
    path.write_text('{"input": "a"}\n{"input": "b"}\n')
    request = JobRequest(model_name=minilm.name, input_uri=str(path), params={"batch_size": 8})
    job = job_submit(tenant=acme, request=request)
    member = _client(person("alice", acme))
    assert 'id="rerun-form"' in member.get(f"/jobs/{job.pk}/").content.decode()

    answer = member.post(f"/jobs/{job.pk}/rerun/", {"model": minilm.name, "params": '{"batch_size": 4}'}, follow=True)

    rerun = Job.objects.get(rerun_of=job)
    assert answer.redirect_chain[-1][0] == f"/jobs/{rerun.pk}/"
    assert "Re-running as job" in answer.content.decode()
    assert rerun.params["batch_size"] == 4
