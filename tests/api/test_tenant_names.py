"""Tenants see their own names, never the platform's: a job whose error and manifest name the storage root,
the platform's folder, the tenant's number and the operators' model and adapter sources is shown by the job
API, its manifest, the portal's job page, an OpenAI batch and an Anthropic message batch's results without
any of them. (Against a live stack with real jobs: tests/abuse/test_tenant_names.py.)"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from portal.anthropic_api.models import MessageBatch
from portal.anthropic_api.selectors import message_batch_results
from portal.catalog.models import Model
from portal.jobs.models import Job, JobStatus
from portal.openai_api.models import Batch
from portal.tenancy.models import ApiKey
from portal.tenancy.stored_files import uploads_root
from tasks.shared.storage import join_uri, store_for
from tests.api.conftest import Caller
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db

MODEL_SOURCE = "/srv/operators/weights/secret-minilm"


@pytest.fixture
def job(caller: Callable[..., Caller], tmp_path: Path) -> tuple[Caller, Job, list[str]]:
    """A failed job of a model kept at MODEL_SOURCE, its input an upload, its error and an old-form manifest
    naming every platform name; with the names none of its tenant's answers may hold."""
    alice = caller("acme")
    model = ModelFactory(name="tiny-embed", source=MODEL_SOURCE, is_default=False)
    upload = join_uri(uploads_root(alice.tenant.pk), "in.jsonl")
    with store_for(upload).open_write(upload) as out:
        out.write(b'{"custom_id": "a", "input": "x"}\n')
    job_id = "0f0f0f0f-0000-4000-8000-000000000001"
    root = join_uri(settings.BATCHERY_STORAGE_URL, "jobs", job_id)
    adapter_source = join_uri(settings.BATCHERY_STORAGE_URL, "adapters", str(alice.tenant.pk), "abc123")
    job = Job.objects.create(
        id=job_id,
        tenant=alice.tenant,
        model=model,
        input_uri=upload,
        output_uri=join_uri(root, "output.jsonl"),
        errors_uri=join_uri(root, "errors.jsonl"),
        status=JobStatus.FAILED,
        finished_at=timezone.now(),
        adapters={"bot": {"id": 1, "spec": {"name": "bot", "version": "1", "source": adapter_source, "rank": 4}}},
        error=f"cannot load {MODEL_SOURCE}/config.json; cannot read {upload}; "
        f"cannot write {join_uri(root, 'shards/00000')} under {settings.VAR_DIR}/tmp",
        provenance={
            "model": {"name": "tiny-embed", "version": "1", "source": MODEL_SOURCE, "weights_digest": ""},
            "adapters": {"bot": {"version": "1", "source": adapter_source, "rank": 4}},
            "input": {"uri": upload, "digest": "", "records": 1},
            "output": {"uri": join_uri(root, "output.jsonl"), "errors_uri": join_uri(root, "errors.jsonl"),
                       "format": "jsonl"},
        },
    )  # fmt: skip
    storage = settings.BATCHERY_STORAGE_URL.rstrip("/")
    forbidden = [storage, storage.removeprefix("file://"), str(settings.VAR_DIR), MODEL_SOURCE,
                 f"uploads/{alice.tenant.pk}/", f"adapters/{alice.tenant.pk}/"]  # fmt: skip
    return alice, job, forbidden


def _clean(text: str, forbidden: list[str]) -> None:
    found = [name for name in forbidden if name in text]
    assert not found, f"{found} in {text[:2000]}"


def test_the_job_api_its_manifest_and_the_portal_page_show_no_platform_name(
    job: tuple[Caller, Job, list[str]],
) -> None:
    alice, failed, forbidden = job
    shown = alice.client.get(f"/api/v1/jobs/{failed.pk}/")
    assert shown.status_code == 200
    _clean(shown.content.decode(), forbidden)
    assert shown.json()["input_uri"] == "upload://in.jsonl"
    assert "<tiny-embed@1>/config.json" in shown.json()["error"]

    manifest = alice.client.get(f"/api/v1/jobs/{failed.pk}/manifest/")
    assert manifest.status_code == 200
    _clean(manifest.content.decode(), forbidden)
    body = manifest.json()
    assert "source" not in body["model"] and "source" not in body["adapters"]["bot"]
    assert body["input"]["uri"] == "upload://in.jsonl"
    assert body["output"]["uri"] == f"batchery://jobs/{failed.pk}/output.jsonl"

    portal = Client()
    portal.force_login(alice.user)
    page = portal.get(f"/jobs/{failed.pk}/")
    assert page.status_code == 200
    _clean(page.content.decode(), forbidden)


def test_an_openai_batch_and_an_anthropic_batchs_results_show_no_platform_name(
    job: tuple[Caller, Job, list[str]],
) -> None:
    alice, failed, forbidden = job
    Batch.objects.create(
        id="batch_names", tenant=alice.tenant, endpoint="/v1/embeddings", completion_window="24h",
        input_file_id="file-1", job=failed, finalized_at=timezone.now(),
    )  # fmt: skip
    batch = alice.client.get("/v1/batches/batch_names")
    assert batch.status_code == 200 and batch.json()["status"] == "failed", batch.content
    _clean(batch.content.decode(), forbidden)
    assert "<tiny-embed@1>" in batch.json()["errors"]["data"][0]["message"]

    message_batch = MessageBatch.objects.create(
        id="msgbatch_names", tenant=alice.tenant, api_key=ApiKey.objects.get(tenant=alice.tenant), job=failed,
        request_count=1, created_at=timezone.now(), expires_at=timezone.now() + dt.timedelta(days=1),
    )  # fmt: skip
    results = b"".join(message_batch_results(message_batch)).decode()
    _clean(results, forbidden)
    error = orjson.loads(results.splitlines()[0])["result"]["error"]["error"]
    assert "<tiny-embed@1>" in error["message"]


def test_a_model_source_is_never_among_what_a_tenant_reads_of_the_catalog(
    caller: Callable[..., Caller], minilm: Model
) -> None:
    listed = caller("acme").client.get("/api/v1/models/")
    assert listed.status_code == 200 and minilm.source not in listed.content.decode()


def test_a_manifest_built_at_the_merge_is_in_its_tenants_form(job: tuple[Caller, Job, list[str]]) -> None:
    from portal.execution.job_manifest import job_manifest

    _, failed, forbidden = job
    built = job_manifest(failed, [], stopped=True)
    _clean(orjson.dumps(built).decode(), forbidden)


def test_a_failed_shards_error_lines_name_no_platform_name(job: tuple[Caller, Job, list[str]]) -> None:
    from portal.execution.shard_outcomes import ShardOutcome, unfinished_lines
    from portal.jobs.models import ShardStatus

    _, failed, forbidden = job
    failed.shards.create(
        index=0, first_record=0, record_count=1, input_uri=failed.input_uri, prefix_uri=failed.output_uri,
        status=ShardStatus.FAILED, error=failed.error,
    )  # fmt: skip
    shard = failed.shards.get()  # read as the merge reads it, through its job
    lines = unfinished_lines(ShardOutcome(shard=shard, manifest=None, failure=shard.error))
    text = b"".join(line for _, line in lines).decode()
    _clean(text, forbidden)
    assert "<tiny-embed@1>/config.json" in text
