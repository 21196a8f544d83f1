"""Keys authenticate; revoked or expired ones get 401; roles decide what a caller may do."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from portal.jobs.models import Job
from portal.tenancy.apikeys import apikey_create, apikey_revoke
from portal.tenancy.invitations import invitation_accept
from portal.tenancy.models import ApiKey, Membership
from tests.api.conftest import Caller
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_no_credentials_get_401_in_the_error_shape() -> None:
    response = APIClient().get("/api/v1/jobs/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "not_authenticated"


def test_a_revoked_key_gets_401(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    assert alice.client.get("/api/v1/jobs/").status_code == 200
    apikey_revoke(key=ApiKey.objects.get(user=alice.user))
    response = alice.client.get("/api/v1/jobs/")
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]


def test_an_expired_key_gets_401(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    _, expired = apikey_create(
        tenant=alice.tenant, user=alice.user, expires_at=timezone.now() - dt.timedelta(seconds=1)
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {expired}")
    assert client.get("/api/v1/models/").status_code == 401


def test_a_malformed_or_unknown_key_gets_401(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    for header in ("Bearer", "Bearer a b", "Bearer bk_00000000_nope", f"Bearer {alice.key}x"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=header)
        assert client.get("/api/v1/jobs/").status_code == 401, header


def test_a_key_whose_user_left_the_tenant_gets_401(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    Membership.objects.filter(user=alice.user).delete()
    assert alice.client.get("/api/v1/jobs/").status_code == 401


def test_a_viewer_reads_but_may_not_submit_and_is_told_why(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    viewer = caller("acme", Membership.Role.VIEWER)
    assert viewer.client.get("/api/v1/jobs/").status_code == 200
    assert viewer.client.get("/api/v1/models/").status_code == 200
    path = write_jsonl([{"custom_id": "a", "input": "hello"}])
    with path.open("rb") as upload:
        response = viewer.client.post("/api/v1/jobs/", {"model": minilm.name, "file": upload}, format="multipart")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "permission_error"
    assert "viewer" in error["message"] and "member" in error["message"]
    assert not Job.objects.exists()


def test_only_admins_manage_keys_and_members(caller: Callable[..., Caller]) -> None:
    member = caller("acme", Membership.Role.MEMBER)
    admin = caller("acme", Membership.Role.ADMIN)
    assert member.client.get("/api/v1/api-keys/").status_code == 403
    assert member.client.post("/api/v1/invitations/", {"username": "bob", "role": "viewer"}).status_code == 403

    created = admin.client.post("/api/v1/api-keys/", {"name": "ci"}, format="json")
    assert created.status_code == 201
    body = created.json()
    assert body["key"].startswith(f"bk_{body['prefix']}_")
    listed = admin.client.get("/api/v1/api-keys/").json()["results"]
    assert {row["prefix"] for row in listed} >= {body["prefix"]}
    assert all("key" not in row for row in listed)

    invited = admin.client.post("/api/v1/invitations/", {"username": "bob", "role": "viewer"}, format="json")
    assert invited.status_code == 201
    added = invitation_accept(invitation_id=invited.json()["id"], user=UserFactory(username="bob"))
    # An admin may not hand out the owner role; only an owner may.
    promoted = admin.client.patch(f"/api/v1/members/{added.pk}/", {"role": "owner"}, format="json")
    assert promoted.status_code == 409
    assert "owner" in promoted.json()["error"]["message"]

    revoked = admin.client.delete(f"/api/v1/api-keys/{body['id']}/")
    assert revoked.status_code == 204
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {body['key']}")
    assert client.get("/api/v1/jobs/").status_code == 401


def test_a_session_user_of_several_tenants_names_one_in_a_header(caller: Callable[..., Caller]) -> None:
    alice = caller("acme", Membership.Role.MEMBER, username="alice")
    caller("globex", Membership.Role.VIEWER, username="alice")
    client = APIClient()
    client.force_login(alice.user)
    ambiguous = client.get("/api/v1/jobs/")
    assert ambiguous.status_code == 403
    assert "X-Batchery-Tenant" in ambiguous.json()["error"]["message"]
    assert client.get("/api/v1/jobs/", HTTP_X_BATCHERY_TENANT="globex").status_code == 200
    assert client.get("/api/v1/jobs/", HTTP_X_BATCHERY_TENANT="initech").status_code == 403
