"""Attacks with request bodies: declared far over their limits, or sent without a length."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tests.abuse.conftest import scale
from tests.support.abuse import AbuseResult, AbuseStack

pytestmark = [pytest.mark.slow, pytest.mark.abuse]


def _raw_post(base_url: str, path: str, headers: dict[str, str], body: bytes = b"") -> str:
    """POST with exactly these headers and body (the body may be much shorter than declared); the
    status line of the answer, which must come without the rest of the body being sent."""
    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
        head = f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
        conn.sendall(head.encode() + body)
        answer = conn.recv(65536).decode(errors="replace")
    return answer.split("\r\n", 1)[0]


def test_bodies_declared_over_their_limits_are_refused_unread(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("body-attacker")
    requests = scale(40, 400)
    targets = [
        ("/api/v1/jobs/", "application/json"),
        ("/v1/batches", "application/json"),
        ("/api/v1/jobs/", "multipart/form-data; boundary=x"),
        ("/v1/files", "multipart/form-data; boundary=x"),
        ("/jobs/new/", "multipart/form-data; boundary=x"),
    ]

    def attack() -> str:
        def one(n: int) -> str:
            path, content_type = targets[n % len(targets)]
            headers = {
                "Authorization": f"Bearer {attacker.api_key}",
                "Content-Type": content_type,
                "Content-Length": str(100 * 1024**3),
            }
            return _raw_post(abuse_stack.base_url, path, headers, body=b"{" * 1024)

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(one, range(requests)))
        assert all(" 413 " in line for line in statuses), statuses
        chunked = _raw_post(
            abuse_stack.base_url,
            "/api/v1/jobs/",
            {"Authorization": f"Bearer {attacker.api_key}", "Content-Type": "application/json",
             "Transfer-Encoding": "chunked"},
            body=b"400\r\n" + b"[" * 1024 + b"\r\n",
        )  # fmt: skip
        assert " 411 " in chunked, chunked
        return f"{requests} x 100 GiB declared: 413 unread; chunked: 411"

    result = abuse_report("request bodies over their limits", attack)
    assert result.bytes_written < 1024 * 1024


def test_a_json_body_just_over_the_limit_is_refused(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("json-attacker")

    def attack() -> str:
        body = b'{"model": "x", "pad": "' + b"x" * (10 * 1024 * 1024) + b'"}'
        with abuse_stack.api(attacker) as client:
            answer = client.post("/api/v1/jobs/", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 413, answer.text
        assert "BATCHERY_MAX_REQUEST_BYTES" in answer.json()["error"]["message"]
        return "10 MiB JSON: 413 naming BATCHERY_MAX_REQUEST_BYTES"

    abuse_report("a JSON body over the limit", attack)
