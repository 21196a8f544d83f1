"""Writes to tenants and memberships; membership changes are audited as `membership.changed`, an
operator's change to a tenant's share of the fleet as `tenant.changed`."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import User
from django.db import transaction
from django.forms import BaseModelFormSet
from django.utils import timezone

from portal.audit.services import (
    audit_change,
    audit_record,
    audited_formset_save,
    audited_save,
    field_values,
    stored_field_values,
)
from portal.tenancy.apikeys import apikeys_revoke_of_member
from portal.tenancy.models import Invitation, Membership, Quota, Tenant, invitation_backed


def tenant_create(*, name: str, priority: int = 5) -> Tenant:
    if not name.strip():
        raise ValueError("a tenant needs a name")
    with transaction.atomic():
        tenant = Tenant.objects.create(name=name.strip(), priority=priority)
        Quota.objects.create(tenant=tenant)
    return tenant


def tenant_save(*, tenant: Tenant, actor: User | None) -> None:
    """Save a tenant edited by hand (the admin) and record the change."""
    audited_save(obj=tenant, actor=actor, action="tenant.changed", tenant=tenant)


ROW_ACTIONS: dict[type | None, str] = {Quota: "quota.changed", Membership: "membership.changed"}
"""The audit action of each kind of a tenant's rows edited by hand."""


def tenant_rows_save(*, tenant: Tenant, formset: BaseModelFormSet, actor: User | None) -> None:
    """Save a tenant's quota or memberships edited by hand (the admin's inlines), each row recorded.
    A member removed there loses their keys for the tenant, as through `membership_remove`."""
    action = ROW_ACTIONS.get(formset.model)
    if action is None:
        formset.save()
        return
    with transaction.atomic():
        audited_formset_save(formset=formset, actor=actor, action=action, tenant=tenant)
        if formset.model is Membership:
            for row in formset.deleted_forms:
                apikeys_revoke_of_member(tenant=tenant, user=row.instance.user, actor=actor)
            for row in formset.forms:
                if row.instance.user_id is not None:
                    invitations_revoke_unbacked(inviter=row.instance.user, actor=actor)


def users_deactivate(*, users: Iterable[User], actor: User | None) -> int:
    """Deactivate users (an operator's admin action): each saved, which bumps the auth epoch (`key_cache`) so
    their keys stop in every process at once, their pending invitations refused (`invitations`), and each
    recorded. The one way a user is deactivated: a query set's `update(is_active=False)` would skip the
    epoch (tests/portal/tenancy/test_auth_epoch.py holds the code to it). The number deactivated."""
    done = 0
    with transaction.atomic():
        for user in users:
            if not user.is_active:
                continue
            user.is_active = False
            user.save(update_fields=["is_active"])
            invitations_revoke_unbacked(inviter=user, actor=actor)
            audit_record(
                actor=actor,
                action="user.deactivated",
                target=user,
                summary=f"{user.get_username()} deactivated",
                changes={"is_active": [True, False]},
            )
            done += 1
    return done


def user_save(*, user: User, actor: User | None) -> None:
    """Save a user changed by hand (the admin's user form). Active unticked deactivates the user through
    `users_deactivate`, as the admin's action does: the rest of the change saved as it is, then the
    deactivation with its audit entry and its invitations revoked."""
    deactivating = (
        user.pk is not None and not user.is_active and User.objects.filter(pk=user.pk, is_active=True).exists()
    )
    with transaction.atomic():
        if deactivating:
            user.is_active = True
        user.save()
        if deactivating:
            users_deactivate(users=[user], actor=actor)


def user_get_or_create(*, username: str) -> User:
    """The user of this name, created (with no password: it signs in with its API keys) if there is none."""
    user, _ = User.objects.get_or_create(username=username)
    return user


def tenant_get_or_create(*, name: str) -> Tenant:
    tenant = Tenant.objects.filter(name=name).first()
    return tenant if tenant is not None else tenant_create(name=name)


def tenant_set_share(
    *, tenant: Tenant, actor: User | None, weight: float | None = None, priority: int | None = None
) -> Tenant:
    """Set a tenant's fair-share weight and/or priority (operators only; the caller checks). The
    scheduler reads them on its next decision; shards already sent keep their place."""
    before = stored_field_values(tenant)
    if weight is not None:
        tenant.weight = weight
    if priority is not None:
        tenant.priority = priority
    tenant.full_clean(validate_unique=False, validate_constraints=False)
    tenant.save(update_fields=["weight", "priority"])
    audit_change(
        actor=actor, action="tenant.changed", target=tenant, before=before, after=field_values(tenant), tenant=tenant
    )
    return tenant


class MembershipRefused(Exception):
    """The change would break a rule about roles; the message says which."""


def check_may_touch(actor_role: str, *roles: str) -> None:
    if Membership.Role.OWNER in roles and actor_role != Membership.Role.OWNER:
        raise MembershipRefused("only an owner may grant, change or remove the owner role")


def _check_keeps_an_owner(membership: Membership) -> None:
    if membership.role == Membership.Role.OWNER:
        owners = Membership.objects.filter(tenant_id=membership.tenant_id, role=Membership.Role.OWNER).count()
        if owners <= 1:
            raise MembershipRefused("a tenant keeps at least one owner")


def _audit_role(membership: Membership, old: str | None, new: str | None, actor: User | None, what: str) -> None:
    audit_record(
        actor=actor,
        action="membership.changed",
        target=membership,
        tenant=membership.tenant,
        summary=f"{membership.user.get_username()} {what} in {membership.tenant.name}",
        changes={"role": [old, new]},
    )


def membership_add(
    *, tenant: Tenant, username: str, role: str, actor_role: str, actor: User | None = None
) -> Membership:
    """Add a user (created if new, without a password: they sign in once an operator sets one).

    For operators only (`manage.py apikey create`): a tenant admin invites, and the person joins by
    accepting (portal.tenancy.invitations)."""
    check_may_touch(actor_role, role)
    with transaction.atomic():
        user, _ = User.objects.get_or_create(username=username)
        if Membership.objects.filter(tenant=tenant, user=user).exists():
            raise MembershipRefused(f"{username} is already a member of {tenant.name}")
        membership = Membership.objects.create(tenant=tenant, user=user, role=role)
        _audit_role(membership, None, role, actor, f"added as {role}")
    return membership


def membership_set_role(*, membership: Membership, role: str, actor_role: str, actor: User | None = None) -> Membership:
    check_may_touch(actor_role, role, membership.role)
    with transaction.atomic():
        locked = Membership.objects.select_for_update().get(pk=membership.pk)
        if role != Membership.Role.OWNER:
            _check_keeps_an_owner(locked)
        old = locked.role
        locked.role = role
        locked.save(update_fields=["role"])
        if old != role:
            _audit_role(locked, old, role, actor, f"changed from {old} to {role}")
            invitations_revoke_unbacked(inviter=locked.user, actor=actor)
    return locked


def membership_remove(*, membership: Membership, actor_role: str, actor: User | None = None) -> None:
    check_may_touch(actor_role, membership.role)
    with transaction.atomic():
        locked = Membership.objects.select_for_update().get(pk=membership.pk)
        _check_keeps_an_owner(locked)
        # Recorded before the row goes, so the entry still names it.
        _audit_role(locked, locked.role, None, actor, "removed")
        membership.delete()
        # Their keys end with their membership: adding them back later does not revive them.
        apikeys_revoke_of_member(tenant=locked.tenant, user=locked.user, actor=actor)
        invitations_revoke_unbacked(inviter=locked.user, actor=actor)


def invitations_revoke_unbacked(*, inviter: User, actor: User | None) -> int:
    """Revoke the pending invitations `inviter` made that they may no longer make (removed from the tenant,
    demoted below admin, or below owner for an owner's invitation, or deactivated), each audited; the
    number revoked. Acceptance refuses such an invitation however its inviter lost the right
    (`invitations._answerable`); this makes the tenant's list say so."""
    now = timezone.now()
    pending = Invitation.objects.filter(
        inviter=inviter, accepted_at=None, declined_at=None, revoked_at=None, expires_at__gt=now
    )
    revoked = 0
    for invitation in pending.exclude(pk__in=Invitation.objects.filter(invitation_backed()).values("pk")):
        if Invitation.objects.filter(pk=invitation.pk, revoked_at=None).update(revoked_at=now):
            revoked += 1
            audit_record(
                actor=actor,
                action="invitation.revoked",
                target=invitation,
                tenant=invitation.tenant,
                summary=f"{invitation.invitee} no longer invited to {invitation.tenant.name} as {invitation.role}: "
                f"{inviter.get_username()}, who invited them, may no longer",
            )
    return revoked
