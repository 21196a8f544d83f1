"""Invitations: how a person joins a tenant, with their consent.

A tenant admin invites a user name or an email address with a role (`invitation_create`); nothing
changes for the invited person until they accept it, signed in as themselves (`invitation_accept`),
which creates the membership; they may decline it instead, and an admin may revoke it while it is
pending. An invitation is only as good as its inviter's standing: one whose inviter is no longer an
admin (an owner, for the owner role) of the tenant, or no longer active, is revoked when that changes
(`services.invitations_revoke_unbacked`) and refused whatever way it changed (`models.invitation_backed`).
Only operators create accounts (the admin, `manage.py createsuperuser`, `manage.py apikey create`): an
invitation to a name that has no account yet waits until an operator creates one, and
the inviter is never told whether the account exists. Each step is audited as `invitation.<step>`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from portal.audit.services import audit_record
from portal.tenancy.models import Invitation, Membership, Tenant, invitation_backed
from portal.tenancy.services import MembershipRefused, check_may_touch


class InvitationRefused(Exception):
    """The invitation cannot be made or answered now; the message says why."""


class TooManyInvitations(InvitationRefused):
    """The tenant has BATCHERY_MAX_PENDING_INVITATIONS waiting already."""


def _pending() -> Q:
    return Q(accepted_at=None, declined_at=None, revoked_at=None, expires_at__gt=timezone.now())


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _audit(invitation: Invitation, action: str, actor: User | None, what: str) -> None:
    audit_record(
        actor=actor,
        action=f"invitation.{action}",
        target=invitation,
        tenant=invitation.tenant,
        summary=f"{invitation.invitee} {what} {invitation.tenant.name} as {invitation.role}",
    )


def invitation_create(
    *, tenant: Tenant, username: str = "", email: str = "", role: str, actor_role: str, actor: User | None
) -> tuple[Invitation, str]:
    """Invite a person to `tenant`; return the invitation with the token of its accept link, which is not
    stored and cannot be shown again."""
    username, email = username.strip(), email.strip()
    if not username and not email:
        raise InvitationRefused("name the person to invite: a user name or an email address")
    try:
        check_may_touch(actor_role, role)
    except MembershipRefused as exc:
        raise InvitationRefused(str(exc)) from None
    if username and Membership.objects.filter(tenant=tenant, user__username=username).exists():
        raise InvitationRefused(f"{username} is already a member of {tenant.name}")
    now = timezone.now()
    token = secrets.token_urlsafe(32)
    with transaction.atomic():
        # The tenant's row locked: two invitations made at once are counted one after the other.
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        pending = Invitation.objects.filter(_pending(), tenant=tenant)
        same = (Q(username=username) if username else Q()) | (Q(email__iexact=email) if email else Q())
        if pending.filter(same).exists():
            raise InvitationRefused(f"{username or email} has an invitation to {tenant.name} waiting already")
        limit = settings.BATCHERY_MAX_PENDING_INVITATIONS
        if pending.count() >= limit:
            raise TooManyInvitations(
                f"{tenant.name} has {limit} invitations waiting (BATCHERY_MAX_PENDING_INVITATIONS); "
                "revoke some or wait for answers"
            )
        invitation = Invitation.objects.create(
            tenant=tenant,
            username=username,
            email=email,
            role=role,
            token_digest=_digest(token),
            inviter=actor,
            expires_at=now + dt.timedelta(days=settings.BATCHERY_INVITATION_EXPIRY_DAYS),
        )
        _audit(invitation, "created", actor, "invited to")
    return invitation, token


def invitations_pending_for(user: User) -> QuerySet[Invitation]:
    """The invitations waiting for `user`'s answer, newest first."""
    named = Q(username=user.get_username())
    if user.email:
        named |= Q(email__iexact=user.email)
    return Invitation.objects.filter(named, _pending(), invitation_backed()).select_related("tenant", "inviter")


def invitation_by_token(token: str) -> Invitation | None:
    return Invitation.objects.select_related("tenant").filter(token_digest=_digest(token)).first()


def _answerable(invitation_id: int, user: User) -> Invitation:
    """The invitation, locked, if `user` may answer it now."""
    invitation = Invitation.objects.select_for_update().select_related("tenant").filter(pk=invitation_id).first()
    # Someone else's invitation is treated as no invitation: its existence is not theirs to learn.
    if invitation is None or not invitation.is_for(user):
        raise InvitationRefused("there is no such invitation for you")
    if not user.is_active:
        raise InvitationRefused("your account is deactivated")
    if invitation.status != "pending":
        raise InvitationRefused(f"this invitation to {invitation.tenant.name} is {invitation.status}")
    # Its inviter removed, demoted or deactivated since, by whatever way (`membership_*` revoke it, an
    # operator's edit may not): the invitation grants nothing they no longer may.
    if not Invitation.objects.filter(invitation_backed(), pk=invitation.pk).exists():
        raise InvitationRefused(f"this invitation to {invitation.tenant.name} is revoked")
    return invitation


def invitation_accept(*, invitation_id: int, user: User) -> Membership:
    """Join the invitation's tenant with its role: the membership is made only here, by the invitee."""
    with transaction.atomic():
        locked = _answerable(invitation_id, user)
        membership = Membership.objects.filter(tenant=locked.tenant, user=user).first()
        if membership is not None:
            raise InvitationRefused(f"you are already a member of {locked.tenant.name}")
        membership = Membership.objects.create(tenant=locked.tenant, user=user, role=locked.role)
        locked.accepted_at = timezone.now()
        locked.save(update_fields=["accepted_at"])
        _audit(locked, "accepted", user, "accepted the invitation to")
        audit_record(
            actor=user,
            action="membership.changed",
            target=membership,
            tenant=locked.tenant,
            summary=f"{user.get_username()} joined {locked.tenant.name} as {locked.role} by invitation",
            changes={"role": [None, locked.role]},
        )
    return membership


def invitation_decline(*, invitation_id: int, user: User) -> None:
    with transaction.atomic():
        locked = _answerable(invitation_id, user)
        locked.declined_at = timezone.now()
        locked.save(update_fields=["declined_at"])
        _audit(locked, "declined", user, "declined the invitation to")


def invitation_revoke(*, invitation: Invitation, actor: User | None) -> bool:
    """Withdraw a pending invitation; True if this call did."""
    with transaction.atomic():
        revoked = (
            Invitation.objects.filter(pk=invitation.pk, accepted_at=None, declined_at=None, revoked_at=None).update(
                revoked_at=timezone.now()
            )
            > 0
        )
        if revoked:
            _audit(invitation, "revoked", actor, "no longer invited to")
    return revoked
