"""`GET /api/v1/jobs/{id}/manifest/`: the job's provenance manifest once merged, 409 before, 404 to another
tenant; the portal's job page shows its digests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.test import Client

from portal.jobs.models import Job, JobStatus
from tests.api.conftest import Caller

MANIFEST = {
    "manifest_version": 1,
    "model": {"name": "m", "version": "1", "weights_digest": "sha256:" + "a" * 64, "tokenizer_digest": "", "files": {}},
    "mixed_weights": False,
    "weights": [],
    "engine": {"name": "python", "versions": [{"versions": {"python": "3.11.7"}, "shards": 1}]},
    "params_digest": "sha256:" + "b" * 64,
    "record_params": {"records": 0, "digests": {}},
    "seed": None,
    "input": {"digest": "sha256:" + "c" * 64, "records": 3},
    "gpu_classes": ["cpu"],
    "hosts": ["h1"],
    "batchery_version": "0.1.0",
}


def test_a_merged_job_answers_its_manifest_and_one_not_merged_409(caller: Callable[..., Caller], minilm: Any) -> None:
    alice = caller("acme")
    merged = Job.objects.create(
        tenant=alice.tenant, model=minilm, input_uri="file:///x.jsonl", status=JobStatus.SUCCEEDED, provenance=MANIFEST
    )
    running = Job.objects.create(tenant=alice.tenant, model=minilm, input_uri="file:///x.jsonl")

    assert alice.client.get(f"/api/v1/jobs/{merged.pk}/manifest/").json() == MANIFEST
    refused = alice.client.get(f"/api/v1/jobs/{running.pk}/manifest/")
    assert refused.status_code == 409
    assert "written when its output is merged" in refused.json()["error"]["message"]
    assert caller("globex").client.get(f"/api/v1/jobs/{merged.pk}/manifest/").status_code == 404
    # The job itself does not carry it: a list page would read kilobytes a job.
    assert "provenance" not in alice.client.get(f"/api/v1/jobs/{merged.pk}/").json()


def test_the_job_page_shows_the_weights_and_input_digests(caller: Callable[..., Caller], minilm: Any) -> None:
    alice = caller("acme")
    job = Job.objects.create(
        tenant=alice.tenant, model=minilm, input_uri="file:///x.jsonl", status=JobStatus.SUCCEEDED, provenance=MANIFEST
    )
    client = Client()
    client.force_login(alice.user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-provenance"' in page
    assert MANIFEST["model"]["weights_digest"] in page  # type: ignore[index]
    assert MANIFEST["input"]["digest"] in page  # type: ignore[index]
