"""Nobody joins a tenant without consent: a tenant admin invites, the invited person accepts (or
declines) in the portal, and only acceptance makes a membership. Through the real API and portal."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from portal.audit.models import AuditEntry
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Invitation, Membership, Tenant
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def _api(user: User, tenant_name: str) -> APIClient:
    _, key = apikey_create(tenant=Tenant.objects.get(name=tenant_name), user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def _signed_in(username: str) -> Client:
    client = Client()
    assert client.post("/login/", {"username": username, "password": PASSWORD}).status_code == 302
    return client


def _invite(admin: APIClient, username: str = "", email: str = "", role: str = "member") -> dict[str, object]:
    response = admin.post("/api/v1/invitations/", {"username": username, "email": email, "role": role}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_a_tenant_admin_cannot_attach_another_tenants_user_or_an_operator(person: Callable[..., User]) -> None:
    alice = person("alice", "acme")
    User.objects.create_superuser("root", "root@example.com", PASSWORD)
    mallory = _api(person("mallory", "evil", role=Membership.Role.OWNER), "evil")

    for victim in ("alice", "root"):
        refused = mallory.post("/api/v1/members/", {"username": victim, "role": "admin"}, format="json")
        assert refused.status_code == 405
        assert refused.json()["error"]["code"] == "invitation_required"
        invited = _invite(mallory, victim, role="admin")
        assert invited["status"] == "pending" and "/invitations/" in str(invited["accept_url"])
    assert not Membership.objects.filter(tenant__name="evil").exclude(user__username="mallory").exists()

    # Alice's portal and API sessions still act for acme alone, as before.
    portal = _signed_in("alice")
    assert portal.get("/").context["portal"].tenant.name == "acme"
    session_api = APIClient()
    session_api.force_login(alice)
    assert session_api.get("/api/v1/jobs/").status_code == 200


def test_the_invitee_accepts_in_the_portal_and_their_default_tenant_stays(person: Callable[..., User]) -> None:
    person("alice", "zeta")
    admin_user = person("ann", "alpha", role=Membership.Role.ADMIN)
    invited = _invite(_api(admin_user, "alpha"), "alice", role="viewer")
    portal = _signed_in("alice")

    listed = portal.get("/invitations/")
    assert listed.status_code == 200 and b"alpha" in listed.content
    link = portal.get(str(invited["accept_url"]).split("testserver", 1)[-1])
    assert link.status_code == 200 and b"alpha" in link.content

    accepted = portal.post(f"/invitations/{invited['id']}/accept/")
    assert accepted.status_code == 302
    membership = Membership.objects.get(user__username="alice", tenant__name="alpha")
    assert membership.role == "viewer"
    # She chose alpha just now: this session acts for it.
    assert portal.get("/").context["portal"].tenant.name == "alpha"
    # A new session starts in the tenant she joined first, though alpha comes first by name.
    assert _signed_in("alice").get("/").context["portal"].tenant.name == "zeta"

    actions = set(AuditEntry.objects.filter(target_type="tenancy.invitation").values_list("action", "actor__username"))
    assert actions == {("invitation.created", "ann"), ("invitation.accepted", "alice")}
    assert portal.post(f"/invitations/{invited['id']}/accept/").status_code == 409


def test_a_declined_or_revoked_invitation_makes_no_membership(person: Callable[..., User]) -> None:
    person("alice", "acme")
    admin = _api(person("ann", "beta", role=Membership.Role.ADMIN), "beta")
    portal = _signed_in("alice")

    declined = _invite(admin, "alice")
    assert portal.post(f"/invitations/{declined['id']}/decline/").status_code == 302
    assert portal.post(f"/invitations/{declined['id']}/accept/").status_code == 409

    revoked = _invite(admin, "alice")
    assert admin.delete(f"/api/v1/invitations/{revoked['id']}/").status_code == 204
    assert portal.post(f"/invitations/{revoked['id']}/accept/").status_code == 409

    expired = _invite(admin, "alice")
    Invitation.objects.filter(pk=expired["id"]).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert portal.post(f"/invitations/{expired['id']}/accept/").status_code == 409

    assert not Membership.objects.filter(tenant__name="beta", user__username="alice").exists()
    actions = set(AuditEntry.objects.filter(target_type="tenancy.invitation").values_list("action", flat=True))
    assert actions == {"invitation.created", "invitation.declined", "invitation.revoked"}
    assert {row["status"] for row in admin.get("/api/v1/invitations/").json()["results"]} == {
        "declined",
        "revoked",
        "expired",
    }


def test_only_the_invited_person_sees_or_answers_an_invitation(person: Callable[..., User]) -> None:
    person("alice", "acme")
    person("bob", "acme")
    invited = _invite(_api(person("ann", "beta", role=Membership.Role.ADMIN), "beta"), "alice")
    bob = _signed_in("bob")

    assert b"beta" not in bob.get("/invitations/").content
    assert bob.get(str(invited["accept_url"]).split("testserver", 1)[-1]).status_code == 404
    assert bob.post(f"/invitations/{invited['id']}/accept/").status_code == 409
    assert not Membership.objects.filter(tenant__name="beta", user__username="bob").exists()
    # Another tenant's admin does not see it either.
    other = _api(person("otto", "gamma", role=Membership.Role.ADMIN), "gamma")
    assert other.get(f"/api/v1/invitations/{invited['id']}/").status_code == 404
    assert other.delete(f"/api/v1/invitations/{invited['id']}/").status_code == 404


def test_an_invitation_to_an_unknown_name_waits_for_the_operator_to_create_the_account(
    person: Callable[..., User],
) -> None:
    admin = _api(person("ann", "beta", role=Membership.Role.ADMIN), "beta")
    # The inviter is not told whether the account exists.
    by_email = _invite(admin, email="Carol@Example.com")
    assert not User.objects.filter(username="carol").exists()

    carol = person("carol")  # the operator creates the account later
    carol.email = "carol@example.com"
    carol.save()
    portal = _signed_in("carol")
    # With no tenant yet, the portal sends her to what waits for her.
    assert portal.get("/").headers["Location"] == "/invitations/"
    assert portal.post(f"/invitations/{by_email['id']}/accept/").status_code == 302
    assert portal.get("/").context["portal"].tenant.name == "beta"


def test_an_admin_may_not_invite_an_owner_and_nobody_invites_a_member_twice(person: Callable[..., User]) -> None:
    person("alice", "beta")
    admin = _api(person("ann", "beta", role=Membership.Role.ADMIN), "beta")
    owner = admin.post("/api/v1/invitations/", {"username": "bob", "role": "owner"}, format="json")
    assert owner.status_code == 409 and "owner" in owner.json()["error"]["message"]
    member = admin.post("/api/v1/invitations/", {"username": "alice"}, format="json")
    assert member.status_code == 409 and "already a member" in member.json()["error"]["message"]
    nobody = admin.post("/api/v1/invitations/", {"role": "member"}, format="json")
    assert nobody.status_code == 400 and nobody.json()["error"]["param"] == "username"


def test_a_tenant_admin_invites_and_removes_from_the_portals_members_page(person: Callable[..., User]) -> None:
    person("alice", "acme")
    ann = person("ann", "beta", role=Membership.Role.ADMIN)
    bob = person("bob", "beta")
    _, bob_key = apikey_create(tenant=Tenant.objects.get(name="beta"), user=bob)
    admin = _signed_in("ann")

    invited = admin.post("/members/", {"username": "alice", "email": "", "role": "viewer"})
    assert invited.status_code == 200 and b"/invitations/" in invited.content
    assert invited["Cache-Control"] == "no-store"
    assert not Membership.objects.filter(tenant__name="beta", user__username="alice").exists()
    invitation = Invitation.objects.get(tenant__name="beta", username="alice")
    assert invitation.inviter == ann and invitation.status == "pending"
    assert admin.post("/members/", {"username": "", "email": "", "role": "member"}).status_code == 200
    assert Invitation.objects.count() == 1

    assert admin.post(f"/members/invitations/{invitation.pk}/revoke/").status_code == 302
    invitation.refresh_from_db()
    assert invitation.status == "revoked"

    membership = Membership.objects.get(tenant__name="beta", user=bob)
    assert admin.post(f"/members/{membership.pk}/remove/").status_code == 302
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {bob_key}")
    assert client.get("/api/v1/jobs/").status_code == 401
    # A plain member sees no members page.
    assert _signed_in("alice").get("/members/").status_code == 403


def test_invitations_waiting_are_bounded_per_tenant_and_per_person(person: Callable[..., User], settings: Any) -> None:
    settings.BATCHERY_MAX_PENDING_INVITATIONS = 3
    admin = _api(person("ann", "beta", role=Membership.Role.ADMIN), "beta")
    _invite(admin, "alice")
    again = admin.post("/api/v1/invitations/", {"email": "x@example.com", "username": "alice"}, format="json")
    assert again.status_code == 409 and "waiting already" in again.json()["error"]["message"]
    _invite(admin, "bob")
    _invite(admin, email="carol@example.com")
    over = admin.post("/api/v1/invitations/", {"username": "dave"}, format="json")
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "too_many_invitations"
    assert "BATCHERY_MAX_PENDING_INVITATIONS" in over.json()["error"]["message"]
    assert over["x-should-retry"] == "false"
