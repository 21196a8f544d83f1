"""Failed API-key attempts are throttled by client address and by key prefix (429 with Retry-After, in
the API's error shape), on the REST API and the OpenAI-compatible one; valid keys are never throttled,
whoever shares their address. Counts live in the real Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db

LIMIT = 5


@pytest.fixture(autouse=True)
def small_limit(settings: Any) -> None:
    settings.BATCHERY_API_KEY_FAILURE_LIMIT = LIMIT
    settings.BATCHERY_API_KEY_FAILURE_WINDOW_S = 120


def _client(key: str, address: str = "127.0.0.1") -> APIClient:
    client = APIClient(REMOTE_ADDR=address)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def test_bad_keys_from_one_address_get_429_while_a_good_key_from_it_gets_200(caller: Callable[..., Caller]) -> None:
    victim = caller("globex")
    attacker = _client("bk_00000000_guessed")
    for _ in range(LIMIT):
        assert attacker.get("/api/v1/jobs/").status_code == 401

    throttled = attacker.get("/api/v1/jobs/")
    assert throttled.status_code == 429
    assert 1 <= int(throttled["Retry-After"]) <= 120
    error = throttled.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "throttled"
    assert "BATCHERY_API_KEY_FAILURE_LIMIT" in error["message"]
    # Any bad key from that address, on either API, malformed or not.
    assert _client("nonsense").get("/v1/batches").status_code == 429
    assert _client("bk_11111111_other").get("/v1/files").status_code == 429

    # Another tenant's good key from the same address goes on, on both APIs.
    assert victim.client.get("/api/v1/jobs/").status_code == 200
    assert victim.client.get("/v1/batches").status_code == 200
    # Another address's failures are its own.
    assert _client("bk_22222222_guessed", "10.0.0.7").get("/api/v1/jobs/").status_code == 401


def test_bad_secrets_for_one_key_prefix_get_429_from_any_address(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    prefix = alice.key.split("_")[1]
    for n in range(LIMIT):
        assert _client(f"bk_{prefix}_wrong{n}", f"10.0.1.{n}").get("/api/v1/jobs/").status_code == 401
    assert _client(f"bk_{prefix}_wrong", "10.0.2.1").get("/api/v1/jobs/").status_code == 429
    # The key itself still works.
    assert alice.client.get("/api/v1/jobs/").status_code == 200
