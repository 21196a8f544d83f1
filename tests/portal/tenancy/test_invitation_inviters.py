"""An invitation is only as good as its inviter's standing: one made by an admin who is since removed,
demoted or deactivated is revoked, and refused at acceptance whatever way the inviter lost the right."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User

from portal.tenancy.invitations import (
    InvitationRefused,
    invitation_accept,
    invitation_create,
    invitations_pending_for,
)
from portal.tenancy.models import Invitation, Membership, Tenant
from portal.tenancy.services import membership_remove, membership_set_role, users_deactivate
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

OWNER = Membership.Role.OWNER


@pytest.fixture
def invited(acme: Tenant) -> Callable[..., tuple[Membership, Invitation, User]]:
    """An admin (or owner) of acme who invites bob (with `role`), bob's account, and the owner that stays."""
    MembershipFactory(tenant=acme, user=UserFactory(username="olga"), role=OWNER)

    def make(role: str = Membership.Role.MEMBER, inviter_role: str = Membership.Role.ADMIN) -> Any:
        membership = MembershipFactory(tenant=acme, user=UserFactory(username="ada"), role=inviter_role)
        invitation, _ = invitation_create(
            tenant=acme, username="bob", role=role, actor_role=inviter_role, actor=membership.user
        )
        return membership, invitation, UserFactory(username="bob")

    return make


def _refused(invitation: Invitation, bob: User) -> None:
    assert list(invitations_pending_for(bob)) == []
    with pytest.raises(InvitationRefused, match="is revoked"):
        invitation_accept(invitation_id=invitation.pk, user=bob)
    assert not Membership.objects.filter(user=bob).exists()


def test_an_invitation_still_backed_by_its_inviter_is_accepted(invited: Callable[..., Any]) -> None:
    _, invitation, bob = invited()
    assert list(invitations_pending_for(bob)) == [invitation]
    assert invitation_accept(invitation_id=invitation.pk, user=bob).role == Membership.Role.MEMBER


def test_a_removed_admins_invitations_are_revoked(invited: Callable[..., Any]) -> None:
    membership, invitation, bob = invited()
    membership_remove(membership=membership, actor_role=OWNER)
    invitation.refresh_from_db()
    assert invitation.status == "revoked"
    _refused(invitation, bob)


@pytest.mark.parametrize(
    ("role", "inviter_role", "demoted_to"),
    [(Membership.Role.MEMBER, Membership.Role.ADMIN, Membership.Role.MEMBER), (OWNER, OWNER, Membership.Role.ADMIN)],
)
def test_a_demoted_inviters_invitations_they_may_no_longer_make_are_revoked(
    invited: Callable[..., Any], role: str, inviter_role: str, demoted_to: str
) -> None:
    membership, invitation, bob = invited(role, inviter_role)
    membership_set_role(membership=membership, role=demoted_to, actor_role=OWNER)
    invitation.refresh_from_db()
    assert invitation.status == "revoked"
    _refused(invitation, bob)


def test_a_deactivated_inviters_invitations_are_revoked(invited: Callable[..., Any]) -> None:
    membership, invitation, bob = invited()
    users_deactivate(users=[membership.user], actor=None)
    invitation.refresh_from_db()
    assert invitation.status == "revoked"
    _refused(invitation, bob)


@pytest.mark.parametrize("change", ["deleted", "demoted", "deactivated", "inviter deleted"])
def test_an_inviter_who_lost_the_right_around_the_services_backs_no_invitation(
    invited: Callable[..., Any], change: str
) -> None:
    membership, invitation, bob = invited()
    rows = Membership.objects.filter(pk=membership.pk)
    if change == "deleted":
        rows.delete()
    elif change == "demoted":
        rows.update(role=Membership.Role.VIEWER)
    elif change == "deactivated":
        User.objects.filter(pk=membership.user_id).update(is_active=False)
    else:
        membership.user.delete()
    _refused(invitation, bob)
