"""Where a tenant's jobs may read from: its prefixes and uploads, never outside, never a host."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import SubmissionError
from portal.jobs.services.input_access import input_refusal
from portal.jobs.services.rerun import job_rerun
from tasks.shared.storage import StorageError, store_for
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db


@pytest.fixture
def http_server() -> Iterator[list[str]]:
    """A web server on 127.0.0.1 that records every request it gets."""
    seen: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"custom_id": "a", "input": "x"}\n')

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    seen.append(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()


def _submit(caller: Caller, model: Any, uri: str) -> Any:
    return caller.client.post("/api/v1/jobs/", {"model": model.name, "input_uri": uri}, format="json")


def test_uris_outside_the_tenants_locations_are_refused_and_nothing_is_read(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path, http_server: list[str]
) -> None:
    alice = caller("acme")
    root = tmp_path / "acme"
    root.mkdir()
    inside = write_jsonl([{"custom_id": "a", "input": "hello"}], name="acme/in.jsonl")
    secret = write_jsonl([{"custom_id": "s", "input": "secret"}], name="secret.jsonl")
    (root / "escape.jsonl").symlink_to(secret)
    alice.tenant.storage_prefixes = [root.as_uri() + "/", "s3://datasets/acme/"]
    alice.tenant.save()

    assert _submit(alice, minilm, inside.as_uri()).status_code == 201

    base = http_server[0]
    refused = {
        "s3://datasets/globex/in.jsonl": "outside the locations this tenant may read",
        "s3://datasets/acme/../globex/in.jsonl": "'.' or '..' segment",
        # urlparse reads `?/../../globex/in.jsonl` as a query; the store sends it as part of the key.
        "s3://datasets/acme/x?/../../globex/in.jsonl": "'.' or '..' segment",
        "s3://datasets/acme/x#/../../globex/in.jsonl": "'.' or '..' segment",
        "s3://datasets/acme/./in.jsonl": "'.' or '..' segment",
        (root / ".." / "secret.jsonl").as_uri(): "outside the locations",
        (root / "escape.jsonl").as_uri(): "outside the locations",
        f"{base}/in.jsonl": "does not fetch from hosts",
        f"https://127.0.0.1:{base.rsplit(':', 1)[1]}/in.jsonl": "does not fetch from hosts",
    }
    for uri, reason in refused.items():
        response = _submit(alice, minilm, uri)
        assert response.status_code == 400, uri
        error = response.json()["error"]
        assert error["param"] == "input_uri" and reason in error["message"], (uri, error)
    assert http_server[1:] == [], "the server was asked for something"
    assert Job.objects.count() == 1


def test_a_root_covers_its_folder_not_a_sibling_with_the_same_prefix() -> None:
    assert input_refusal("s3://bkt/acme/x.jsonl", ["s3://bkt/acme"]) is None
    assert input_refusal("s3://bkt/acme-evil/x.jsonl", ["s3://bkt/acme"]) is not None
    assert input_refusal("s3://bkt-evil/acme/x.jsonl", ["s3://bkt"]) is not None
    assert input_refusal("ftp://host/x", ["s3://bkt"]) is not None


def test_an_s3_input_is_checked_by_the_key_the_store_reads(s3: Any) -> None:
    """The check and the store read one key: what passes the check is what the store opens, and a URI whose
    key the HTTP client would resolve to another object is refused by both."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.server_url, region_name="us-east-1")
    client.create_bucket(Bucket="datasets")
    client.put_object(Bucket="datasets", Key="acme/in?x.jsonl", Body=b"acme")
    client.put_object(Bucket="datasets", Key="globex/in.jsonl", Body=b"globex")
    roots = ["s3://datasets/acme/"]
    allowed = "s3://datasets/acme/in?x.jsonl"
    assert input_refusal(allowed, roots) is None
    with store_for(allowed).open_read(allowed) as stream:
        assert stream.read() == b"acme"
    climbing = "s3://datasets/acme/x?/../../globex/in.jsonl"
    assert "'.' or '..' segment" in (input_refusal(climbing, roots) or "")
    with pytest.raises(StorageError, match="segment"):
        store_for(climbing).open_read(climbing)


def _swap_for_link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _storage_holds(marker: bytes, settings: Any) -> bool:
    root = Path(settings.BATCHERY_STORAGE_URL.removeprefix("file://"))
    return any(marker in path.read_bytes() for path in root.rglob("*") if path.is_file())


@pytest.mark.parametrize("checked_at_submission", [True, False])
def test_a_file_input_swapped_for_a_link_out_of_the_roots_fails_the_job_and_nothing_of_it_is_read(
    caller: Callable[..., Caller],
    minilm: Any,
    write_jsonl: Callable[..., Path],
    tmp_path: Path,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
    checked_at_submission: bool,
) -> None:
    if not checked_at_submission:
        settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    alice = caller("acme")
    root = tmp_path / "acme"
    root.mkdir()
    alice.tenant.storage_prefixes = [root.as_uri() + "/"]
    alice.tenant.save()
    inside = write_jsonl([{"custom_id": "a", "input": "hello"}], name="acme/in.jsonl")
    secret = write_jsonl([{"custom_id": "s", "input": "TOP-SECRET-MARKER"}], name="secret.jsonl")
    response = _submit(alice, minilm, inside.as_uri())
    assert response.status_code == 201
    job = Job.objects.get(pk=response.json()["id"])
    assert job.input_uri == inside.resolve().as_uri()  # the real path that was checked

    _swap_for_link(inside, secret)
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))

    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "symbolic link" in job.error and "does not follow it" in job.error
    assert not _storage_holds(b"TOP-SECRET-MARKER", settings)


def test_a_folder_on_the_way_swapped_for_a_link_is_not_followed_either(
    caller: Callable[..., Caller],
    minilm: Any,
    write_jsonl: Callable[..., Path],
    tmp_path: Path,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    alice = caller("acme")
    root = tmp_path / "acme"
    (root / "data").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    alice.tenant.storage_prefixes = [root.as_uri() + "/"]
    alice.tenant.save()
    write_jsonl([{"custom_id": "s", "input": "TOP-SECRET-MARKER"}], name="elsewhere/in.jsonl")
    inside = write_jsonl([{"custom_id": "a", "input": "hello"}], name="acme/data/in.jsonl")
    job_id = _submit(alice, minilm, inside.as_uri()).json()["id"]
    inside.unlink()
    (root / "data").rmdir()
    (root / "data").symlink_to(tmp_path / "elsewhere")
    with django_capture_on_commit_callbacks():
        job_plan(job_id=job_id)
    job = Job.objects.get(pk=job_id)
    assert job.status == JobStatus.FAILED and "symbolic link" in job.error
    assert not _storage_holds(b"TOP-SECRET-MARKER", settings)


def test_an_operators_rerun_keeps_the_tenants_input_roots(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    root = tmp_path / "acme"
    root.mkdir()
    alice.tenant.storage_prefixes = [root.as_uri() + "/"]
    alice.tenant.save()
    inside = write_jsonl([{"custom_id": "a", "input": "hello"}], name="acme/in.jsonl")
    secret = write_jsonl([{"custom_id": "s", "input": "TOP-SECRET-MARKER"}], name="secret.jsonl")
    job = Job.objects.get(pk=_submit(alice, minilm, inside.as_uri()).json()["id"])
    _swap_for_link(inside, secret)
    with pytest.raises(SubmissionError, match="outside the locations this tenant may read"):
        job_rerun(job=job, actor=None)
    assert Job.objects.count() == 1


def test_a_refusal_lists_the_tenants_uploads_without_the_platforms_storage_root(
    caller: Callable[..., Caller], minilm: Any, settings: Any
) -> None:
    alice = caller("acme")
    request = {"model": minilm.name, "input_uri": "file:///etc/passwd"}
    refused = alice.client.post("/api/v1/jobs/", request, format="json")
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "outside the locations this tenant may read (allowed: upload://)" in message
    root = settings.BATCHERY_STORAGE_URL.rstrip("/")
    assert root not in refused.text and root.removeprefix("file://") not in refused.text
