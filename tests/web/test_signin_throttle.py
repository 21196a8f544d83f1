"""Failed portal and admin sign-ins are throttled by django-axes, per client address and per user name,
with counts in the real Redis: 429 with Retry-After; other people's sign-ins go on."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client

from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def _fail_until_throttled(client: Client, path: str, username: str) -> None:
    for _ in range(settings.BATCHERY_LOGIN_FAILURE_LIMIT - 1):
        assert client.post(path, {"username": username, "password": "wrong"}).status_code == 200
    refused = client.post(path, {"username": username, "password": "wrong"})
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) == settings.BATCHERY_LOGIN_COOLOFF_S
    assert b"BATCHERY_LOGIN_FAILURE_LIMIT" in refused.content


def test_failed_sign_ins_from_one_address_get_429_and_others_sign_in(person: Callable[..., User]) -> None:
    person("alice", "acme")
    person("bob", "acme")
    attacker = Client(REMOTE_ADDR="10.0.0.66")
    _fail_until_throttled(attacker, "/login/", "nobody-in-particular")

    # The address is throttled for every name, the right password included, on the admin's sign-in too.
    assert attacker.post("/login/", {"username": "bob", "password": PASSWORD}).status_code == 429
    assert attacker.post("/admin/login/", {"username": "bob", "password": PASSWORD}).status_code == 429
    # Someone at another address signs in.
    signed_in = Client(REMOTE_ADDR="10.0.0.5").post("/login/", {"username": "alice", "password": PASSWORD})
    assert signed_in.status_code == 302


def test_failed_sign_ins_for_one_name_get_429_from_any_address(person: Callable[..., User]) -> None:
    person("alice", "acme")
    for n in range(settings.BATCHERY_LOGIN_FAILURE_LIMIT - 1):
        client = Client(REMOTE_ADDR=f"10.0.3.{n}")
        assert client.post("/admin/login/", {"username": "alice", "password": "wrong"}).status_code == 200
    assert Client(REMOTE_ADDR="10.0.4.1").post("/login/", {"username": "alice", "password": "x"}).status_code == 429


def test_a_common_password_is_refused() -> None:
    with pytest.raises(ValidationError, match="too common"):
        validate_password("password123")
