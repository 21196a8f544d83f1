"""Every request body has a size limit, refused from its Content-Length before a byte of it is read."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from portal.jobs.models import Job
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db


class _UnreadableBody(io.RawIOBase):
    """A request body the application must not read."""

    read_calls = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.read_calls += 1
        raise AssertionError("the body of a request over its limit was read")


def _call_wsgi(path: str, content_type: str, content_length: str, **headers: str) -> tuple[str, dict[str, str], bytes]:
    """Call the portal's WSGI application as gunicorn would, with a body it must not read."""
    from portal.wsgi import application

    answered: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        answered["status"] = status
        answered["headers"] = dict(response_headers)

    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": _UnreadableBody(),
        "wsgi.errors": io.StringIO(),
        "CONTENT_TYPE": content_type,
        "CONTENT_LENGTH": content_length,
        **{f"HTTP_{name.upper()}": value for name, value in headers.items()},
    }
    body = b"".join(application(environ, start_response))
    return answered["status"], answered["headers"], body


@pytest.mark.parametrize(
    ("path", "content_type", "setting"),
    [
        ("/api/v1/jobs/", "application/json", "BATCHERY_MAX_REQUEST_BYTES"),
        ("/v1/batches", "application/json", "BATCHERY_MAX_REQUEST_BYTES"),
        ("/api/v1/jobs/", "multipart/form-data; boundary=x", "BATCHERY_MAX_UPLOAD_BYTES"),
        ("/v1/files", "multipart/form-data; boundary=x", "BATCHERY_MAX_UPLOAD_BYTES"),
    ],
)
def test_a_declared_body_over_its_limit_is_refused_413_unread(path: str, content_type: str, setting: str) -> None:
    status, headers, body = _call_wsgi(path, content_type, str(50 * 1024**3), authorization="Bearer bk_anything")
    assert status.startswith("413")
    error = json.loads(body)["error"]
    assert error["code"] == "payload_too_large"
    assert setting in error["message"] and str(50 * 1024**3) in error["message"]
    # A WSGI application sets no hop-by-hop header (PEP 3333): the server closes the unread connection.
    assert "Connection" not in headers


def test_the_message_batches_api_refuses_an_oversized_or_chunked_body_in_anthropics_shape() -> None:
    status, headers, body = _call_wsgi("/v1/messages/batches", "application/json", str(50 * 1024**3), x_api_key="k")
    assert status.startswith("413")
    answer = json.loads(body)
    assert answer["type"] == "error" and answer["error"]["type"] == "request_too_large"
    assert "BATCHERY_MAX_REQUEST_BYTES" in answer["error"]["message"]
    assert headers["x-should-retry"] == "false", "Anthropic's clients would retry it otherwise"

    status, _, body = _call_wsgi("/v1/messages/batches", "application/json", "", transfer_encoding="chunked")
    assert status.startswith("411")
    assert json.loads(body)["error"] == {
        "type": "invalid_request_error",
        "message": "a request body must come with its Content-Length (not chunked)",
    }


def test_the_portal_submit_form_refuses_an_oversized_upload_unread(settings: Any) -> None:
    settings.BATCHERY_MAX_UPLOAD_BYTES = 1024 * 1024
    status, _, body = _call_wsgi("/jobs/new/", "multipart/form-data; boundary=x", str(3 * 1024 * 1024))
    assert status.startswith("413")
    assert b"BATCHERY_MAX_UPLOAD_BYTES" in body


def test_a_chunked_body_without_a_length_is_refused_411() -> None:
    status, _, body = _call_wsgi("/api/v1/jobs/", "application/json", "", transfer_encoding="chunked")
    assert status.startswith("411")
    assert json.loads(body)["error"]["code"] == "length_required"


def test_a_json_body_over_the_limit_is_refused_before_it_is_parsed(
    caller: Callable[..., Caller], minilm: Any, settings: Any
) -> None:
    settings.BATCHERY_MAX_REQUEST_BYTES = 4096
    alice = caller("acme")
    request = {"model": minilm.name, "input_uri": "file:///nowhere.jsonl", "params": {"pad": "x" * 8000}}
    response = alice.client.post("/api/v1/jobs/", request, format="json")
    assert response.status_code == 413
    assert "4096 bytes (BATCHERY_MAX_REQUEST_BYTES)" in response.json()["error"]["message"]
    assert not Job.objects.exists()
    small = alice.client.post("/api/v1/jobs/", {**request, "params": {}}, format="json")
    assert small.status_code == 400  # read and judged: the input is outside the tenant's roots


def test_a_body_within_its_limit_is_served(settings: Any) -> None:
    settings.BATCHERY_MAX_REQUEST_BYTES = 4096
    response = Client().post("/login/", {"username": "nobody", "password": "wrong"})
    assert response.status_code == 200
