from __future__ import annotations

import datetime as dt
import io
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from portal.tenancy.apikeys import apikey_authenticate, apikey_create, apikey_revoke
from portal.tenancy.models import ApiKey, Membership
from tests.factories import UserFactory


@pytest.fixture
def alice(db: None) -> Any:
    return UserFactory(username="alice")


def test_a_key_is_shown_once_and_stored_only_as_a_hash_with_a_visible_prefix(acme: Any, alice: Any) -> None:
    key, plaintext = apikey_create(tenant=acme, user=alice, name="ci")
    assert plaintext.startswith(f"bk_{key.prefix}_")
    stored = ApiKey.objects.get(pk=key.pk)
    assert plaintext not in {stored.hashed_key, stored.prefix, stored.name}
    assert len(stored.hashed_key) == 64


def test_the_key_authenticates_as_its_tenant_and_user(acme: Any, alice: Any) -> None:
    _, plaintext = apikey_create(tenant=acme, user=alice)
    key = apikey_authenticate(plaintext)
    assert key is not None
    assert (key.tenant, key.user) == (acme, alice)
    assert ApiKey.objects.get(pk=key.pk).last_used_at is not None


@pytest.mark.parametrize(
    "tamper", [lambda k: k[:-1] + ("A" if k[-1] != "A" else "B"), lambda k: "bk_nope_x", str.upper]
)
def test_a_wrong_key_does_not_authenticate(acme: Any, alice: Any, tamper: Any) -> None:
    _, plaintext = apikey_create(tenant=acme, user=alice)
    assert apikey_authenticate(tamper(plaintext)) is None


def test_a_revoked_or_expired_key_does_not_authenticate(acme: Any, alice: Any) -> None:
    revoked, revoked_text = apikey_create(tenant=acme, user=alice)
    apikey_revoke(key=revoked)
    _, expired_text = apikey_create(tenant=acme, user=alice, expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert apikey_authenticate(revoked_text) is None
    assert apikey_authenticate(expired_text) is None


def test_the_command_creates_user_and_membership_and_prints_the_key_alone_on_a_line(acme: Any) -> None:
    out = io.StringIO()
    call_command("apikey", "create", "--tenant", "acme", "--user", "bob", "--role", "admin", stdout=out)
    (line,) = out.getvalue().splitlines()
    key = apikey_authenticate(line)
    assert key is not None
    assert key.user.username == "bob"
    assert Membership.objects.get(user=key.user, tenant=acme).role == "admin"


def test_the_command_names_a_missing_tenant(db: None) -> None:
    with pytest.raises(CommandError, match="no tenant named 'ghost'"):
        call_command("apikey", "create", "--tenant", "ghost", "--user", "bob")
