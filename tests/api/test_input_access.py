"""Where a tenant's jobs may read from: its prefixes and uploads, never outside, never a host."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.jobs.models import Job
from portal.jobs.services.input_access import input_refusal
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
        "s3://datasets/acme/../globex/in.jsonl": "contains '..'",
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
    assert input_refusal("s3://b/acme/x.jsonl", ["s3://b/acme"]) is None
    assert input_refusal("s3://b/acme-evil/x.jsonl", ["s3://b/acme"]) is not None
    assert input_refusal("ftp://host/x", ["s3://b"]) is not None
