"""An account that ends takes its access with it: a deactivated user's keys and sessions, a removed
member's keys for that tenant. The key cache (real Redis) holds nothing past the change."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.test import Client
from rest_framework.test import APIClient

from portal.audit.models import AuditEntry
from portal.tenancy.models import ApiKey, Membership
from portal.tenancy.services import membership_add
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db


def _deactivate(user: object) -> None:
    user.is_active = False  # type: ignore[attr-defined]
    user.save()  # type: ignore[attr-defined]


@pytest.mark.parametrize("staff", [False, True], ids=["member", "staff"])
def test_a_deactivated_users_key_gets_401_at_once(caller: Callable[..., Caller], staff: bool) -> None:
    alice = caller("acme", Membership.Role.OWNER)
    alice.user.is_staff = alice.user.is_superuser = staff
    alice.user.save()
    # Twice: the second answer comes from the process's key cache.
    assert alice.client.get("/api/v1/jobs/").status_code == 200
    assert alice.client.get("/api/v1/jobs/").status_code == 200

    _deactivate(alice.user)

    for path in ("/api/v1/jobs/", "/v1/batches"):
        response = alice.client.get(path)
        assert response.status_code == 401, path
        assert "deactivated" in response.json()["error"]["message"]


def test_a_deactivated_users_portal_and_api_sessions_stop_at_once(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    alice.user.set_password("a long passphrase of alice")
    alice.user.save()
    portal = Client()
    signed_in = portal.post("/login/", {"username": alice.user.username, "password": "a long passphrase of alice"})
    assert signed_in.status_code == 302
    api = APIClient()
    api.force_login(alice.user)
    assert portal.get("/").status_code == 200
    assert api.get("/api/v1/jobs/").status_code == 200

    _deactivate(alice.user)

    signed_out = portal.get("/")
    assert signed_out.status_code == 302 and signed_out["Location"].startswith("/login/")
    assert api.get("/api/v1/jobs/").status_code in (401, 403)


def test_a_removed_members_keys_are_revoked_audited_and_not_revived(caller: Callable[..., Caller]) -> None:
    owner = caller("acme", Membership.Role.OWNER)
    bob = caller("acme", Membership.Role.MEMBER, username="bob")
    assert bob.client.get("/api/v1/jobs/").status_code == 200
    membership = Membership.objects.get(user=bob.user, tenant=bob.tenant)

    assert owner.client.delete(f"/api/v1/members/{membership.pk}/").status_code == 204

    assert bob.client.get("/api/v1/jobs/").status_code == 401
    key = ApiKey.objects.get(user=bob.user)
    assert key.revoked_at is not None
    entry = AuditEntry.objects.get(action="apikey.revoked", target_id=str(key.pk))
    assert entry.actor == owner.user and "bob left acme" in entry.summary

    # Back in the tenant (an operator's doing), bob needs a new key: the old one stays dead.
    membership_add(tenant=bob.tenant, username="bob", role=Membership.Role.MEMBER, actor_role=Membership.Role.OWNER)
    assert bob.client.get("/api/v1/jobs/").status_code == 401


def test_a_removed_member_keeps_their_keys_of_other_tenants(caller: Callable[..., Caller]) -> None:
    owner = caller("acme", Membership.Role.OWNER)
    bob_acme = caller("acme", Membership.Role.MEMBER, username="bob")
    bob_globex = caller("globex", Membership.Role.MEMBER, username="bob")
    membership = Membership.objects.get(user=bob_acme.user, tenant=bob_acme.tenant)

    assert owner.client.delete(f"/api/v1/members/{membership.pk}/").status_code == 204

    assert bob_acme.client.get("/api/v1/jobs/").status_code == 401
    assert bob_globex.client.get("/api/v1/jobs/").status_code == 200
