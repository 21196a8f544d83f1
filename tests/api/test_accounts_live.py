"""Against a real gunicorn portal of several workers, each with its own key cache: a deactivated
user's key, a removed member's key and a throttled address behave the same in every worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.db import connection

from portal.devstack.embedded import free_port
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Membership
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.support.throttles import throttle_counts_clear
from tests.support.workers import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
FAILURE_LIMIT = 10
# More requests than workers, each on a new connection, so every worker answers some of them.
ROUNDS = 24


@pytest.fixture
def portal_url() -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        # Long enough that only the auth epoch can make a worker forget a key within the test.
        "BATCHERY_API_KEY_CACHE_S": "600",
        "BATCHERY_API_KEY_FAILURE_LIMIT": str(FAILURE_LIMIT),
    }
    command = [sys.executable, "-m", "gunicorn", "portal.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", "3"]
    portal = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the portal did not start"
            time.sleep(0.2)
        yield url
    finally:
        portal.terminate()
        portal.wait(timeout=20)


def _statuses(url: str, key: str, path: str = "/api/v1/jobs/") -> list[int]:
    headers = {"Authorization": f"Bearer {key}", "Connection": "close"}
    return [httpx.get(url + path, headers=headers, timeout=10).status_code for _ in range(ROUNDS)]


def _refused(statuses: list[int]) -> bool:
    """Refused by every worker: 401, then 429 once the address has failed FAILURE_LIMIT times."""
    return statuses[0] == 401 and set(statuses) <= {401, 429}


def _member(tenant: str, username: str, role: str = Membership.Role.MEMBER) -> tuple[object, str]:
    user = UserFactory(username=username)
    found = TenantFactory(name=tenant)
    MembershipFactory(user=user, tenant=found, role=role)
    return user, apikey_create(tenant=found, user=user)[1]


def test_every_worker_refuses_a_deactivated_users_and_a_removed_members_key_at_once(portal_url: str) -> None:
    alice, alice_key = _member("acme", "alice")
    _, owner_key = _member("acme", "olivia", Membership.Role.OWNER)
    bob, bob_key = _member("acme", "bob")
    assert set(_statuses(portal_url, alice_key)) == {200}  # cached by every worker now
    assert set(_statuses(portal_url, bob_key)) == {200}

    alice.is_active = False  # type: ignore[attr-defined]
    alice.save()  # type: ignore[attr-defined]
    assert _refused(_statuses(portal_url, alice_key))

    membership = Membership.objects.get(user=bob, tenant__name="acme")
    removed = httpx.delete(
        f"{portal_url}/api/v1/members/{membership.pk}/", headers={"Authorization": f"Bearer {owner_key}"}, timeout=10
    )
    assert removed.status_code == 204
    throttle_counts_clear()  # alice's refusals counted against this address
    assert _refused(_statuses(portal_url, bob_key))
    assert set(_statuses(portal_url, owner_key)) == {200}


def test_bad_keys_get_429_across_workers_while_a_good_key_from_the_same_address_gets_200(portal_url: str) -> None:
    _, good_key = _member("globex", "grace")
    bad = [httpx.get(f"{portal_url}/v1/batches", headers={"Authorization": f"Bearer bk_{n:08x}_x"}) for n in range(30)]
    statuses = [response.status_code for response in bad]
    assert statuses == [401] * FAILURE_LIMIT + [429] * (30 - FAILURE_LIMIT)
    assert int(bad[-1].headers["Retry-After"]) >= 1
    assert bad[-1].json()["error"]["type"] == "rate_limit_error"
    assert set(_statuses(portal_url, good_key)) == {200}
    assert set(_statuses(portal_url, good_key, "/v1/batches")) == {200}
