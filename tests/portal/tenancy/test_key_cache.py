"""A portal process keeps authenticated keys while the auth epoch in Redis stays the same."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.devstack.embedded import free_port
from portal.tenancy import key_cache
from portal.tenancy.access import access_for_key
from portal.tenancy.apikeys import apikey_authenticate, apikey_create, apikey_revoke
from portal.tenancy.models import ApiKey, Membership
from portal.tenancy.services import membership_set_role
from tests.factories import UserFactory


@pytest.fixture(autouse=True)
def redis_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pause left over from a test whose Redis did not answer."""
    monkeypatch.setattr(key_cache, "_redis_retry_at", 0.0)


@pytest.fixture
def alice_key(acme: Any) -> tuple[Any, str]:
    alice = UserFactory(username="alice")
    Membership.objects.create(tenant=acme, user=alice, role=Membership.Role.MEMBER)
    key, plaintext = apikey_create(tenant=acme, user=alice)
    apikey_authenticate(plaintext)  # the first use writes last_used_at; the next ones write nothing
    return key, plaintext


def test_a_key_used_again_is_not_read_from_the_database(alice_key: tuple[Any, str]) -> None:
    _, plaintext = alice_key
    with CaptureQueriesContext(connection) as captured:
        key = apikey_authenticate(plaintext)
    assert captured.captured_queries == []
    assert key is not None and access_for_key(key) is not None
    assert access_for_key(key).role == Membership.Role.MEMBER  # type: ignore[union-attr]


def test_a_request_changing_what_it_was_given_does_not_change_the_next_ones(alice_key: tuple[Any, str]) -> None:
    _, plaintext = alice_key
    first = apikey_authenticate(plaintext)
    assert first is not None
    first.user.username = "mallory"
    first.tenant.name = "elsewhere"
    again = apikey_authenticate(plaintext)
    assert again is not None and (again.user.username, again.tenant.name) == ("alice", "acme")


def test_a_revoked_key_is_refused_at_once(alice_key: tuple[Any, str]) -> None:
    key, plaintext = alice_key
    apikey_revoke(key=key)
    assert apikey_authenticate(plaintext) is None


def test_a_role_change_holds_from_the_next_request(alice_key: tuple[Any, str]) -> None:
    key, plaintext = alice_key
    membership = Membership.objects.get(user=key.user, tenant=key.tenant)
    membership_set_role(membership=membership, role=Membership.Role.VIEWER, actor_role=Membership.Role.OWNER)
    found = apikey_authenticate(plaintext)
    assert found is not None and access_for_key(found).role == Membership.Role.VIEWER  # type: ignore[union-attr]
    Membership.objects.filter(pk=membership.pk).delete()
    found = apikey_authenticate(plaintext)
    assert found is not None and access_for_key(found) is None


def test_another_process_increments_the_epoch_and_this_one_reads_the_key_again(alice_key: tuple[Any, str]) -> None:
    key, plaintext = alice_key
    # As another portal process's change: the row changed there, the epoch with it, nothing bumped here.
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {ApiKey._meta.db_table} SET name = 'renamed' WHERE id = %s", [key.pk])
    assert apikey_authenticate(plaintext).name == ""  # type: ignore[union-attr]
    key_cache._increment()
    assert apikey_authenticate(plaintext).name == "renamed"  # type: ignore[union-attr]


def test_a_redis_that_does_not_answer_turns_the_cache_off_not_the_check(
    alice_key: tuple[Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key, plaintext = alice_key
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    monkeypatch.setattr(key_cache, "redis_client", lambda: dead)
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=key.created_at)
    with CaptureQueriesContext(connection) as captured:
        assert apikey_authenticate(plaintext) is None
    assert len(captured.captured_queries) == 1


def test_after_redis_failed_to_answer_it_is_asked_again_only_after_a_pause(
    alice_key: tuple[Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, plaintext = alice_key
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    asked: list[int] = []
    monkeypatch.setattr(key_cache, "redis_client", lambda: asked.append(1) or dead)

    assert apikey_authenticate(plaintext) is not None
    assert apikey_authenticate(plaintext) is not None
    assert len(asked) == 1  # the second request went straight to the database
    monkeypatch.setattr(key_cache, "_redis_retry_at", 0.0)
    assert apikey_authenticate(plaintext) is not None and len(asked) == 2


def test_with_no_cache_time_every_request_reads_the_key(alice_key: tuple[Any, str], settings: Any) -> None:
    settings.BATCHERY_API_KEY_CACHE_S = 0
    _, plaintext = alice_key
    key_cache._increment()
    for _ in range(2):
        with CaptureQueriesContext(connection) as captured:
            assert apikey_authenticate(plaintext) is not None
        assert len(captured.captured_queries) == 1
