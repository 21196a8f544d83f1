"""The portal's /metrics behind BATCHERY_METRICS_TOKEN, the token every shipped deployment sets."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_metrics_ask_for_the_bearer_token_when_one_is_set(settings: Any) -> None:
    settings.BATCHERY_METRICS_TOKEN = "s3cret-scrape-token"
    client = Client()

    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"] == "Bearer"
    assert b"batchery_" not in anonymous.content
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    allowed = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-scrape-token")
    assert allowed.status_code == 200 and b"batchery_" in allowed.content
