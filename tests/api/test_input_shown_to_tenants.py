"""A job's input as its tenant sees it (REST, the portal's job page): an upload, stored under the platform's
storage, shows as `upload://<name>`, never the storage root; an input the tenant named shows as given;
operators see the stored URI in the admin."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client, override_settings

from portal.jobs.input_display import shown_input_uri
from portal.jobs.models import Job
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db

RECORDS = [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(3)]


def _uploaded_job(alice: Caller, minilm: Any, path: Path) -> Job:
    with path.open("rb") as handle:
        response = alice.client.post("/api/v1/jobs/", {"file": handle, "model": minilm.name}, format="multipart")
    assert response.status_code == 201, response.json()
    return Job.objects.get(pk=response.json()["id"])


def test_an_uploaded_input_shows_its_name_not_the_platforms_storage_root(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    job = _uploaded_job(alice, minilm, write_jsonl(RECORDS))
    root = settings.BATCHERY_STORAGE_URL
    assert job.input_uri.startswith(root)  # stored under the platform's storage...

    detail = alice.client.get(f"/api/v1/jobs/{job.pk}/")
    listed = alice.client.get("/api/v1/jobs/")

    # ...and shown by the name of the upload alone, in the job and in the list.
    shown = detail.json()["input_uri"]
    assert shown.startswith("upload://") and shown.endswith(Path(job.input_uri).name)
    assert [row["input_uri"] for row in listed.json()["results"]] == [shown]
    for body in (detail.content, listed.content):
        assert root.encode() not in body
        assert root.removeprefix("file://").encode() not in body


def test_an_input_the_tenant_named_is_shown_as_given(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    path = write_jsonl(RECORDS)
    with override_settings(BATCHERY_INPUT_ROOTS=[tmp_path.as_uri()]):
        response = alice.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": path.as_uri()}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["input_uri"] == path.as_uri()
    assert alice.client.get(f"/api/v1/jobs/{response.json()['id']}/").json()["input_uri"] == path.as_uri()


def test_the_portal_job_page_shows_the_uploads_name_and_the_admin_the_stored_uri(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    job = _uploaded_job(alice, minilm, write_jsonl(RECORDS))
    root = settings.BATCHERY_STORAGE_URL
    portal = Client()
    portal.force_login(alice.user)

    page = portal.get(f"/jobs/{job.pk}/")

    assert page.status_code == 200
    text = page.content.decode()
    assert f"upload://{Path(job.input_uri).name}" in text
    assert root not in text and root.removeprefix("file://") not in text
    operator = Client()
    operator.force_login(User.objects.create_superuser("root", "root@example.com", "secret-password"))
    admin_page = operator.get(f"/admin/jobs/job/{job.pk}/change/")
    assert admin_page.status_code == 200 and job.input_uri in admin_page.content.decode()


def test_the_display_rule_keeps_to_path_boundaries(settings: Any) -> None:
    settings.BATCHERY_STORAGE_URL = "s3://platform/batchery"
    assert shown_input_uri("s3://platform/batchery/uploads/7/ab12-in.jsonl", tenant_id=7) == "upload://ab12-in.jsonl"
    # A converted OpenAI batch input, or another tenant's upload: still below the platform's root.
    assert shown_input_uri("s3://platform/batchery/batches/batch_1/input.jsonl", tenant_id=7) == (
        "batchery://batches/batch_1/input.jsonl"
    )
    # A bucket that merely starts like the platform's is the tenant's own.
    assert (
        shown_input_uri("s3://platform/batchery-team/in.jsonl", tenant_id=7) == "s3://platform/batchery-team/in.jsonl"
    )
    assert shown_input_uri("file:///data/in.jsonl", tenant_id=7) == "file:///data/in.jsonl"
    assert shown_input_uri("s3://tenant-bucket/x.jsonl", tenant_id=7) == "s3://tenant-bucket/x.jsonl"


def test_the_shown_upload_name_is_accepted_back_as_an_input_and_reaches_no_other_tenants_uploads(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice, mallory = caller("acme"), caller("globex")
    first = _uploaded_job(alice, minilm, write_jsonl(RECORDS))
    shown = alice.client.get(f"/api/v1/jobs/{first.pk}/").json()["input_uri"]

    again = alice.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": shown}, format="json")

    assert again.status_code == 201, again.json()
    assert again.json()["input_uri"] == shown
    assert Job.objects.get(pk=again.json()["id"]).input_uri == first.input_uri
    # Another tenant naming it reads from their own uploads, where it is not.
    stolen = mallory.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": shown}, format="json")
    assert stolen.status_code == 400 and stolen.json()["error"]["param"] == "input_uri"
    for climbing in ("upload://../acme/x.jsonl", "upload://a/b.jsonl", "upload://.hidden", "upload://"):
        refused = alice.client.post("/api/v1/jobs/", {"model": minilm.name, "input_uri": climbing}, format="json")
        assert refused.status_code == 400, climbing
        assert refused.json()["error"]["param"] == "input_uri"
        assert "does not name an upload" in refused.json()["error"]["message"]
    assert Job.objects.count() == 2


def test_errors_name_stored_inputs_without_the_storage_root(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    root = settings.BATCHERY_STORAGE_URL
    missing = alice.client.post(
        "/api/v1/jobs/", {"model": minilm.name, "input_uri": "upload://nothere.jsonl"}, format="json"
    )
    assert missing.status_code == 400
    assert "upload://nothere.jsonl" in missing.json()["error"]["message"]
    assert root not in missing.content.decode() and root.removeprefix("file://") not in missing.content.decode()
    # A job the planner failed on its stored input: its error, in the API and on the page, hides the root too.
    job = _uploaded_job(alice, minilm, write_jsonl(RECORDS))
    Job.objects.filter(pk=job.pk).update(error=f"cannot read the input: no such object: {job.input_uri}")
    detail = alice.client.get(f"/api/v1/jobs/{job.pk}/").json()
    assert detail["error"] == f"cannot read the input: no such object: upload://{Path(job.input_uri).name}"
    portal = Client()
    portal.force_login(alice.user)
    live = portal.get(f"/jobs/{job.pk}/live/").content.decode()
    assert f"upload://{Path(job.input_uri).name}" in live and root not in live
