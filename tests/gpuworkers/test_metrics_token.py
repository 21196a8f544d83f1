"""The launcher's /metrics behind BATCHERY_METRICS_TOKEN, as the portal's: a real server on 127.0.0.1."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from gpuworkers.metrics_server import serve_metrics
from portal.devstack.embedded import free_port

TOKEN = "s3cret-scrape-token"


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _served(token: str) -> str:
    registry = CollectorRegistry()
    Counter("batchery_probe", "A sample to find.", registry=registry).inc()
    port = free_port()
    assert serve_metrics(registry, port=port, address="127.0.0.1", token=token)
    return f"http://127.0.0.1:{port}"


def test_with_a_token_metrics_need_it_and_healthz_tells_nothing_else() -> None:
    base = _served(TOKEN)

    status, body = _get(f"{base}/metrics")
    assert (status, body) == (401, b"a bearer token is required (BATCHERY_METRICS_TOKEN)\n")
    assert _get(f"{base}/metrics", token="wrong")[0] == 401
    status, body = _get(f"{base}/metrics", token=TOKEN)
    assert status == 200 and b"batchery_probe_total 1.0" in body
    # The liveness probes' page: open, and nothing of the metrics in it.
    assert _get(f"{base}/healthz") == (200, b"ok\n")


@pytest.mark.parametrize("path", ["/metrics", "/"])
def test_without_a_token_metrics_stay_open_as_before(path: str) -> None:
    status, body = _get(_served("") + path)
    assert status == 200 and b"batchery_probe_total" in body
