"""API keys: create (the key is returned once), authenticate, revoke.

A key is `bk_<prefix>_<secret>` with 32 random bytes of secret. Being random and long, it needs no
slow password hash: SHA-256 is enough, and lets every request be checked in microseconds.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from portal.audit.services import audit_record
from portal.tenancy import key_cache
from portal.tenancy.models import ApiKey, Membership, Tenant

KEY_PREFIX = "bk"
# Writing last_used_at on every request would turn reads into writes; once a minute is enough.
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _label(key: ApiKey) -> str:
    return f"{KEY_PREFIX}_{key.prefix}" + (f" ({key.name})" if key.name else "")


def apikey_create(
    *,
    tenant: Tenant,
    user: User,
    name: str = "",
    expires_at: dt.datetime | None = None,
    actor: User | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for `user`; return it with its plaintext, which is not stored and cannot be shown
    again. `actor` is who asked for it, for the audit log."""
    prefix = secrets.token_hex(4)
    plaintext = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    with transaction.atomic():
        key = ApiKey.objects.create(
            tenant=tenant, user=user, name=name, prefix=prefix, hashed_key=_digest(plaintext), expires_at=expires_at
        )
        audit_record(
            actor=actor,
            action="apikey.created",
            target=key,
            tenant=tenant,
            summary=f"API key {_label(key)} created for {user.get_username()}",
            changes={"expires_at": [None, expires_at]} if expires_at else None,
        )
    return key, plaintext


def apikey_authenticate(plaintext: str) -> ApiKey | None:
    """The live key this plaintext is, or None (unknown, wrong secret, revoked, expired, or its user
    deactivated: an account that ended takes its keys with it, staff keys included)."""
    parts = plaintext.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX:
        return None
    digest = _digest(plaintext)
    # Read before the key: a change made after this read makes what is cached under it stale.
    epoch = key_cache.current_epoch()
    key = key_cache.cached_key(digest, epoch) if epoch is not None else None
    if key is None:
        # The user's role in the key's tenant comes in the same query (`access_for_key` reads it): one round
        # trip for every API request's authentication, not two.
        role = Membership.objects.filter(user_id=OuterRef("user_id"), tenant_id=OuterRef("tenant_id")).values("role")
        found = ApiKey.objects.select_related("tenant", "user").annotate(member_role=Subquery(role[:1]))
        key = found.filter(prefix=parts[1]).first()
        if key is None or not hmac.compare_digest(key.hashed_key, digest):
            return None
        key_cache.remember_key(digest, key, epoch)
    now = timezone.now()
    if key.revoked_at is not None or (key.expires_at is not None and key.expires_at <= now):
        return None
    # A copy cached before the user was deactivated is gone: saving the user bumped the auth epoch.
    if not key.user.is_active:
        return None
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key_cache.note_key_used(digest, now)
    return key


def apikey_revoke(*, key: ApiKey, actor: User | None = None, reason: str = "") -> bool:
    """Revoke a key; True if this call did (a key already revoked stays as it was). `reason`, when
    given, ends the audit entry's summary (why the key went without its holder asking)."""
    now = timezone.now()
    with transaction.atomic():
        revoked = ApiKey.objects.filter(pk=key.pk, revoked_at=None).update(revoked_at=now) > 0
        if revoked:
            # The update bumped the auth epoch (`AuthQuerySet`): no process serves the key it kept.
            key.revoked_at = now
            audit_record(
                actor=actor,
                action="apikey.revoked",
                target=key,
                tenant=key.tenant,
                summary=f"API key {_label(key)} revoked" + (f": {reason}" if reason else ""),
                changes={"revoked_at": [None, now]},
            )
    return revoked


def apikeys_revoke_of_member(*, tenant: Tenant, user: User, actor: User | None = None) -> int:
    """Revoke every live key `user` holds for `tenant` (they left it); the number revoked."""
    keys = ApiKey.objects.select_related("tenant").filter(tenant=tenant, user=user, revoked_at=None)
    reason = f"{user.get_username()} left {tenant.name}"
    return sum(apikey_revoke(key=key, actor=actor, reason=reason) for key in keys)
