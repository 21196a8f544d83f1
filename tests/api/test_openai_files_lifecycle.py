"""The life of `/v1/files` as at OpenAI: `expires_after` and `output_expires_after` honoured by the sweep,
`files.list` paged up to 10,000 in either order, and no error the official client would retry in vain."""

from __future__ import annotations

import datetime as dt
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.utils import timezone

from portal.jobs.models import Job, JobStatus
from portal.jobs.storage_layout import job_prefix, output_uri
from portal.openai_api.models import Batch, File
from portal.openai_api.services.batches import batch_finalize
from portal.openai_api.services.expiry import files_expire
from portal.ops.periodic import periodic_sweep
from portal.tenancy.models import Membership, Quota
from tasks.shared.storage import join_uri, store_for
from tests.api.conftest import Caller
from tests.support.openai_batches import ENDED, requests_file, wait_for_batch

A_MINUTE = {"anchor": "created_at", "seconds": 60}


@pytest.fixture
def minute_expiry(settings: Any) -> None:
    """Expiry down to a minute, below OpenAI's hour (the live server runs in this process)."""
    settings.BATCHERY_FILE_EXPIRY_MIN_SECONDS = 60


def _client(live_server: Any, key: str, sent: list[httpx.Request] | None = None, retries: int = 0) -> openai.OpenAI:
    """The official client; `sent` collects every request it sends, retries included."""
    hooks = {"request": [sent.append]} if sent is not None else {}
    http = httpx.Client(event_hooks=hooks, timeout=60)
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=retries, http_client=http)


def _embedding_lines(path: Path, count: int = 3) -> Path:
    bodies = [{"model": "all-MiniLM-L6-v2", "input": f"sentence {n}"} for n in range(count)]
    return requests_file(path, "/v1/embeddings", bodies)


def _exists(uri: str) -> bool:
    return store_for(uri).exists(uri)


@pytest.mark.django_db(transaction=True)
def test_a_file_uploaded_to_expire_after_a_minute_is_gone_from_storage_and_the_api_after_the_sweep(
    live_server: Any, caller: Callable[..., Caller], minute_expiry: None, tmp_path: Path
) -> None:
    client = _client(live_server, caller("acme").key)
    path = _embedding_lines(tmp_path / "requests.jsonl")
    with path.open("rb") as handle:
        expiring = client.files.create(file=handle, purpose="batch", expires_after=A_MINUTE)
    with path.open("rb") as handle:
        kept = client.files.create(file=handle, purpose="batch")
    assert expiring.expires_at == expiring.created_at + 60 and kept.expires_at is None
    assert client.files.retrieve(expiring.id).expires_at == expiring.created_at + 60
    uri = File.objects.get(pk=expiring.id).uri
    assert _exists(uri)

    # The minute passes: its end is moved into the past rather than waited for.
    File.objects.filter(pk=expiring.id).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(expiring.id)  # gone for the API at once, before any sweep
    assert _exists(uri)
    swept = periodic_sweep()  # the periodic sweep, as beat runs it

    assert swept["expired_files"] == 1
    assert not File.objects.filter(pk=expiring.id).exists() and not _exists(uri)
    with pytest.raises(openai.NotFoundError):
        client.files.content(expiring.id)
    assert [file.id for file in client.files.list()] == [kept.id]
    assert client.files.content(kept.id).content == path.read_bytes()


@pytest.mark.django_db
def test_an_expired_input_file_is_deleted_only_once_no_batch_that_uses_it_is_running(
    caller: Callable[..., Caller], minute_expiry: None
) -> None:
    alice = caller("acme")
    handle = io.BytesIO(b'{"custom_id": "a"}\n')
    handle.name = "requests.jsonl"
    # The multipart fields exactly as the openai client sends the policy.
    form = {"file": handle, "purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}
    uploaded = alice.client.post("/v1/files", form, format="multipart").json()
    assert uploaded["expires_at"] == uploaded["created_at"] + 60
    file = File.objects.get(pk=uploaded["id"])
    running = Batch.objects.create(
        id="batch_running",
        tenant=alice.tenant,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id=file.id,
    )
    File.objects.filter(pk=file.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))

    held = files_expire()
    assert (held.files, held.held) == (0, 1)
    assert _exists(file.uri) and File.objects.filter(pk=file.pk).exists()
    assert alice.client.get(f"/v1/files/{file.id}").status_code == 404  # expired for the API all the same

    Batch.objects.filter(pk=running.pk).update(finalized_at=timezone.now())
    swept = files_expire()
    assert (swept.files, swept.held) == (1, 0)
    assert not _exists(file.uri) and not File.objects.filter(pk=file.pk).exists()


@pytest.mark.django_db
def test_a_batchs_output_and_error_files_and_its_jobs_objects_expire_as_output_expires_after_says(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    job = Job.objects.create(tenant=alice.tenant, model=minilm, input_uri="file:///unused.jsonl")
    job.output_uri = output_uri(str(job.id))
    job.status, job.shard_count, job.total_records = JobStatus.PARTIALLY_SUCCEEDED, 1, 2
    job.save()
    lines = [
        {"custom_id": "ok", "response": {"embedding": [0.6, 0.8], "usage": {"prompt_tokens": 2}}, "error": None},
        {"custom_id": "bad", "response": None, "error": {"code": "engine_error", "message": "it broke"}},
    ]
    store = store_for(job.output_uri)
    with store.open_write(job.output_uri) as target:
        target.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    shard_object = join_uri(job_prefix(str(job.id)), "shards", "00000", "attempt", "output.jsonl")
    with store.open_write(shard_object) as target:
        target.write(b"{}\n")
    batch = Batch.objects.create(
        id="batch_outputs",
        tenant=alice.tenant,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id="file-input",
        job=job,
        output_expires_after_seconds=3600,
    )

    assert batch_finalize(batch_id=batch.id)
    batch.refresh_from_db()
    assert batch.output_file is not None and batch.error_file is not None
    written = batch.output_file.created_at
    for file in (batch.output_file, batch.error_file):
        # Anchored at the file's creation, as OpenAI's `output_expires_after.anchor` says.
        assert file.expires_at == written + dt.timedelta(seconds=3600)
        shown = alice.client.get(f"/v1/files/{file.id}").json()
        assert shown["expires_at"] == shown["created_at"] + 3600
    output_file, error_file = batch.output_file, batch.error_file

    assert files_expire(now=written + dt.timedelta(seconds=3599)).files == 0
    report = files_expire(now=written + dt.timedelta(seconds=3600))

    assert (report.batches, report.files) == (1, 2)
    assert not File.objects.filter(pk__in=[output_file.pk, error_file.pk]).exists()
    for uri in (output_file.uri, error_file.uri, job.output_uri, shard_object):
        assert not _exists(uri), uri
    assert alice.client.get(f"/v1/files/{output_file.id}").status_code == 404
    shown = alice.client.get(f"/v1/batches/{batch.id}").json()
    assert (shown["status"], shown["output_file_id"], shown["error_file_id"]) == ("completed", None, None)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_batch_run_by_the_official_client_writes_outputs_that_expire_as_it_asked(
    live_server: Any,
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    minilm: Any,
    minute_expiry: None,
    tmp_path: Path,
) -> None:
    client = _client(live_server, caller("acme").key)
    with _embedding_lines(tmp_path / "requests.jsonl").open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        output_expires_after=A_MINUTE,
    )
    batch = wait_for_batch(client, batch.id, ENDED, pipeline_workers)
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 60 and output.created_at >= batch.created_at
    job = Job.objects.get(batch__id=batch.id)
    assert _exists(job.output_uri)

    files_expire(now=timezone.now() + dt.timedelta(seconds=61))

    with pytest.raises(openai.NotFoundError):
        client.files.content(batch.output_file_id)
    assert client.batches.retrieve(batch.id).output_file_id is None
    assert not _exists(job.output_uri)
    assert client.files.retrieve(uploaded.id).expires_at is None  # the input had no policy: kept


@pytest.mark.django_db(transaction=True)
def test_files_list_pages_by_limit_order_and_after_as_the_client_expects(
    live_server: Any, caller: Callable[..., Caller], tmp_path: Path
) -> None:
    client = _client(live_server, caller("acme").key)
    path = _embedding_lines(tmp_path / "requests.jsonl", count=1)
    ids = []
    for _ in range(5):
        with path.open("rb") as handle:
            ids.append(client.files.create(file=handle, purpose="batch").id)

    newest_first = client.files.list()
    assert [file.id for file in newest_first.data] == ids[::-1] and not newest_first.has_more
    oldest_first = client.files.list(limit=2, order="asc")
    assert [file.id for file in oldest_first.data] == ids[:2] and oldest_first.has_more
    assert [file.id for file in oldest_first] == ids  # the client follows `after` from page to page
    assert [file.id for file in client.files.list(order="asc", after=ids[1])] == ids[2:]
    assert [file.id for file in client.files.list(after=ids[3], limit=2).data] == [ids[2], ids[1]]
    assert client.files.list(purpose="batch_output").data == []


@pytest.mark.django_db
def test_files_list_gives_up_to_ten_thousand_files_a_page_by_default(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    File.objects.bulk_create(
        File(id=f"file-{n:05d}", tenant=alice.tenant, purpose="batch", filename="f.jsonl", bytes=1, uri="file:///x")
        for n in range(10_001)
    )
    page = alice.client.get("/v1/files").json()
    assert len(page["data"]) == 10_000 and page["has_more"]
    assert alice.client.get("/v1/files", {"limit": 10_001}).json()["error"]["param"] == "limit"


@pytest.mark.django_db(transaction=True)
def test_bad_expiry_policies_and_list_parameters_are_400s_naming_the_field(
    live_server: Any, caller: Callable[..., Caller], minute_expiry: None, tmp_path: Path
) -> None:
    alice = caller("acme")
    client = _client(live_server, alice.key)
    path = _embedding_lines(tmp_path / "requests.jsonl", count=1)

    def upload(policy: Any) -> Any:
        with path.open("rb") as handle:
            return client.files.create(file=handle, purpose="batch", expires_after=policy)

    refused: list[tuple[Callable[[], Any], str]] = [
        (lambda: upload({"anchor": "created_at", "seconds": 59}), "expires_after.seconds"),
        (lambda: upload({"anchor": "created_at", "seconds": 2_592_001}), "expires_after.seconds"),
        (lambda: upload({"anchor": "created_at", "seconds": "soon"}), "expires_after.seconds"),
        (lambda: upload({"anchor": "last_active_at", "seconds": 3600}), "expires_after.anchor"),
        (lambda: upload({"seconds": 3600}), "expires_after.anchor"),
        (lambda: client.files.list(limit=0), "limit"),
        (lambda: client.files.list(limit=10_001), "limit"),
        (lambda: client.files.list(order="sideways"), "order"),
        (lambda: client.files.list(after="file-nope"), "after"),
    ]
    for policy, param in [
        ({"anchor": "created_at", "seconds": 30}, "output_expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 2_592_001}, "output_expires_after.seconds"),
        ({"anchor": "completed_at", "seconds": 3600}, "output_expires_after.anchor"),
    ]:
        refused.append(
            (
                lambda policy=policy: client.batches.create(
                    input_file_id="file-any",
                    endpoint="/v1/embeddings",
                    completion_window="24h",
                    output_expires_after=policy,
                ),
                param,
            )
        )
    for call, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, caught.value.body
    assert not File.objects.exists() and not Batch.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_no_v1_request_that_cannot_succeed_is_retried_by_the_official_client(
    live_server: Any, caller: Callable[..., Caller], minilm: Any, settings: Any, tmp_path: Path
) -> None:
    alice = caller("acme")
    sent: list[httpx.Request] = []
    client = _client(live_server, alice.key, sent, retries=2)
    good = _embedding_lines(tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")

    def upload(path: Path, purpose: str = "batch", on: openai.OpenAI = client, **extra: Any) -> Any:
        with path.open("rb") as handle:
            return on.files.create(file=handle, purpose=purpose, **extra)

    def create(file_id: str, window: str = "24h") -> Any:
        return client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window=window)

    good_id = upload(good).id
    failed = create(upload(bad).id)
    assert failed.status == "failed"
    job = Job.objects.create(tenant=alice.tenant, model=minilm, input_uri="file:///x.jsonl", status=JobStatus.SUCCEEDED)
    completed = Batch.objects.create(
        id="batch_completed",
        tenant=alice.tenant,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id=good_id,
        job=job,
        finalized_at=timezone.now(),
    )
    viewer = _client(live_server, caller(alice.tenant, Membership.Role.VIEWER).key, sent, retries=2)
    stranger = _client(live_server, "bk_not-a-key", sent, retries=2)

    def too_large() -> Any:
        settings.BATCHERY_MAX_UPLOAD_BYTES = 10
        try:
            return upload(good)
        finally:
            settings.BATCHERY_MAX_UPLOAD_BYTES = 200 * 1024 * 1024

    def over_quota(**limits: Any) -> Callable[[], Any]:
        def call() -> Any:
            Quota.objects.update_or_create(tenant=alice.tenant, defaults=limits)
            try:
                return create(good_id)
            finally:
                Quota.objects.filter(tenant=alice.tenant).update(**dict.fromkeys(limits))

        return call

    never: list[tuple[str, Callable[[], Any], int]] = [
        ("retrieve an unknown file", lambda: client.files.retrieve("file-nope"), 404),
        ("download an unknown file", lambda: client.files.content("file-nope"), 404),
        ("delete an unknown file", lambda: client.files.delete("file-nope"), 404),
        ("upload for another purpose", lambda: upload(good, "fine-tune"), 400),
        ("upload with a bad expiry", lambda: upload(good, expires_after={"anchor": "x", "seconds": 1}), 400),
        ("upload as a viewer", lambda: upload(good, on=viewer), 403),
        ("upload too large", too_large, 413),
        ("list with a bad limit", lambda: client.files.list(limit=0), 400),
        ("call with an unknown key", lambda: stranger.files.list(), 401),
        ("retrieve an unknown batch", lambda: client.batches.retrieve("batch_nope"), 404),
        ("create a batch of an unknown file", lambda: create("file-nope"), 400),
        ("create a batch with a bad window", lambda: create(good_id, window="25x"), 400),
        ("create a batch the tenant's size limit refuses", over_quota(max_input_bytes=1), 429),
        ("cancel an unknown batch", lambda: client.batches.cancel("batch_nope"), 404),
        ("cancel a batch that failed validation", lambda: client.batches.cancel(failed.id), 409),
        ("cancel a completed batch", lambda: client.batches.cancel(completed.id), 409),
        ("read a cancellation", lambda: client.get(f"/batches/{completed.id}/cancel", cast_to=object), 405),
    ]
    for name, call, status in never:
        before = len(sent)
        with pytest.raises(openai.APIStatusError) as caught:
            call()
        assert caught.value.status_code == status, (name, caught.value.body)
        assert len(sent) - before == 1, f"{name}: sent {len(sent) - before} times"
        assert not client._should_retry(caught.value.response), name

    # A refusal that may pass once other jobs end is left for the client to retry.
    before = len(sent)
    with pytest.raises(openai.RateLimitError) as caught:
        over_quota(max_concurrent_jobs=0)()
    assert caught.value.response.headers["x-should-retry"] == "true" and len(sent) - before == 3
