"""Authenticated API keys, kept in each portal process between requests.

Reading a key with its tenant, user and role took a third of a job status request (the query's
compilation and its three joins). A process keeps what it read, by the key's digest, for as long as
the *auth epoch* in Redis stays the same: every change that may alter what a key grants (a key saved,
revoked or deleted; a membership added, changed or removed; a user or a tenant saved or deleted; a
tenant, membership or key query set updated, `models.AuthQuerySet`; a user deactivated, which goes
through `services.users_deactivate`) increments it, so a revocation holds in every process from its
next request. A Redis that does not
answer turns the cache off, never the check: the key is then read from the database.

The epoch is incremented when the change is made and again when its transaction commits: a process
that read the row between the two cached the old state under the first increment, and the second
makes it read again.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models.signals import post_delete, post_save

from portal.tenancy.models import ApiKey, Membership, Tenant, rows_updated
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

EPOCH_KEY = "batchery:auth:epoch"
MAX_ENTRIES = 10_000
"""Keys a process remembers; past that it starts again, which costs one read per key."""
REDIS_RETRY_S = 5.0
"""After Redis failed to answer, this process asks it again only after so long: a Redis cut off by the
network would otherwise hold every API request for the client's connect timeout."""

_redis_retry_at = 0.0


@dataclass
class _Entry:
    key: ApiKey
    epoch: bytes
    cached_at: float


_entries: dict[str, _Entry] = {}


def current_epoch() -> bytes | None:
    """The auth epoch, or None where Redis does not answer (the cache is then not used)."""
    global _redis_retry_at
    if time.monotonic() < _redis_retry_at:
        return None
    client = redis_client()
    try:
        epoch = cast(bytes | None, client.get(EPOCH_KEY))
        if epoch is None:
            # A Redis that restarted has lost the epoch: a fresh random one, so that it does not count
            # up again through values under which processes cached keys before.
            client.set(EPOCH_KEY, secrets.randbelow(2**62), nx=True)
            epoch = cast(bytes | None, client.get(EPOCH_KEY))
    except redis.RedisError as exc:
        logger.warning("auth epoch not read, API keys are read from the database: %s", exc)
        # Increments may be lost while Redis is away: nothing cached before is trusted after.
        _entries.clear()
        _redis_retry_at = time.monotonic() + REDIS_RETRY_S
        return None
    return epoch


def cached_key(digest: str, epoch: bytes) -> ApiKey | None:
    """A copy of the key read under `epoch`, if this process has one young enough."""
    entry = _entries.get(digest)
    if entry is None or entry.epoch != epoch:
        return None
    if time.monotonic() - entry.cached_at > settings.BATCHERY_API_KEY_CACHE_S:
        return None
    return _copy(entry.key)


def remember_key(digest: str, key: ApiKey, epoch: bytes | None) -> None:
    """Keep `key` (read from the database after `epoch` was) for the next requests."""
    if epoch is None or settings.BATCHERY_API_KEY_CACHE_S <= 0:
        return
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[digest] = _Entry(key=_copy(key), epoch=epoch, cached_at=time.monotonic())


def note_key_used(digest: str, when: Any) -> None:
    """The key's `last_used_at` was written: the copy kept says so, so it is not written again at once."""
    entry = _entries.get(digest)
    if entry is not None:
        entry.key.last_used_at = when


def _copy(key: ApiKey) -> ApiKey:
    # A request may change what it was given (its user, say); the next one must not see it.
    found = copy.copy(key)
    found.tenant = copy.copy(key.tenant)
    found.user = copy.copy(key.user)
    return found


def bump_epoch() -> None:
    """Make every process read keys from the database again: now, and once more on commit."""
    _increment()
    transaction.on_commit(_increment)


def _increment() -> None:
    _entries.clear()
    try:
        redis_client().incr(EPOCH_KEY)
    except redis.RedisError as exc:
        # This process forgot its copies; another one that still reads the old epoch keeps its own until they
        # are BATCHERY_API_KEY_CACHE_S old, the bound a lost increment has.
        logger.warning("auth epoch not incremented: %s", exc)


GRANTS_NOTHING: dict[type, frozenset[str]] = {
    ApiKey: frozenset({"last_used_at"}),
    User: frozenset({"last_login"}),  # every sign-in saves it
}
"""Fields whose change alone grants nothing: saving or updating only them leaves the epoch as it is."""


def _changed(sender: type, update_fields: frozenset[str] | None = None, **_: Any) -> None:
    if update_fields is not None and set(update_fields) <= GRANTS_NOTHING.get(sender, frozenset()):
        return
    bump_epoch()


def connect_signals() -> None:
    for model in (ApiKey, Membership, Tenant, User):
        post_save.connect(_changed, sender=model, dispatch_uid=f"key_cache.save.{model.__name__}")
        post_delete.connect(_changed, sender=model, dispatch_uid=f"key_cache.delete.{model.__name__}")
        rows_updated.connect(_changed, sender=model, dispatch_uid=f"key_cache.update.{model.__name__}")
